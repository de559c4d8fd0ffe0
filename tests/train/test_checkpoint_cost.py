"""Checkpoint writes out of the measured step: training throughput leaves out the seconds checkpoint writes and
validation take (a scripted clock, by hand), and last.ckpt is written on a wall-clock interval, every N steps and at
the end, not after every validation (the writes of a real run counted)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

import train
from zoo.train import clock, loop

REPO = Path(__file__).resolve().parents[2]


def test_throughput_leaves_out_checkpoint_writes_and_validation_by_hand(monkeypatch):
    time = {"now": 0.0}
    monkeypatch.setattr(clock, "now", lambda: time["now"])
    timed = clock.RunClock(budget_s=None, scheduled_steps=100, steps_per_epoch=5, val_batches=1)
    timed.start(0)
    cpu = torch.device("cpu")
    for step in range(1, 5):
        time["now"] += 1.0  # one training step: 1 s, 8 images
        timed.images += 8
        if step == 2:
            with timed.paused(cpu):  # an interval checkpoint between steps
                time["now"] += 10.0
    with timed.validation(cpu):
        time["now"] += 5.0
    with timed.paused(cpu):  # best.ckpt, written after validation
        time["now"] += 10.0
    time["now"] += 1.0
    timed.images += 8
    timed.epoch_ended()
    assert timed.val_time == 5.0 and timed.elapsed() == 30.0
    assert timed.trained_seconds() == pytest.approx(5.0)
    assert timed.images_per_s() == pytest.approx(40 / 5.0)
    assert timed.later_images_per_s() is None  # one epoch: nothing after the first
    for _ in range(2):  # a second epoch: 2 steps of 0.5 s
        time["now"] += 0.5
        timed.images += 8
    assert timed.later_images_per_s() == pytest.approx(16 / 1.0)
    assert timed.images_per_s() == pytest.approx(56 / 6.0)
    resumed = clock.RunClock(budget_s=None, scheduled_steps=100, steps_per_epoch=5, val_batches=1)
    resumed.load_state_dict(timed.state_dict())  # a resumed run counts the images and seconds before it
    resumed.start(7)
    time["now"] += 2.0
    resumed.images += 16
    assert resumed.images_per_s() == pytest.approx(72 / 8.0) and resumed.elapsed() == pytest.approx(33.0)


def test_a_runs_summary_leaves_the_checkpoint_writes_out_of_its_images_per_second(cifar_dir, tmp_path, monkeypatch,
                                                                                  capsys):
    """A scripted clock: each training step 1 s, each checkpoint write 10 s, the test after training 1000 s,
    everything else nothing."""
    time = {"now": 0.0}
    monkeypatch.setattr(clock, "now", lambda: time["now"])
    real_save = loop.save_checkpoint

    def slow_save(path, state):
        time["now"] += 10.0
        real_save(path, state)

    class Steps:
        def on_train_batch_start(self, run):
            time["now"] += 1.0

        def on_test_batch_start(self, run):
            time["now"] += 1000.0

    monkeypatch.setattr(loop, "save_checkpoint", slow_save)
    monkeypatch.setattr(loop, "fit", functools.partial(loop.fit, callbacks=[Steps()]))
    args = ["--config", str(REPO / "configs" / "test_tiny.yaml"), "--data-dir", str(cifar_dir), "--cache-dir",
            str(tmp_path / "cache"), "--max-train-images", "64", "--max-test-images", "16", "--set", "val_size=16",
            "--epochs", "2", "--batch-size", "16", "--limit-train-batches", "2", "--limit-val-batches", "1",
            "--limit-test-batches", "1", "--ckpt-every-n-steps", "1", "--out", str(tmp_path / "runs")]
    assert train.main(args) == 0
    run_dir = Path(capsys.readouterr().out.strip().splitlines()[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 4
    assert summary["train_images_per_s"] == pytest.approx(16.0)  # 4 steps of 16 images in 4 s, 60 s of writes out
    assert 4 + 10 * 5 <= summary["wall_time_s"] < 1000  # the writes are in the run's wall time, the test is not


@pytest.mark.parametrize("minutes, every_n_steps, last_steps", [(60.0, 500, [6]), (0.0, 500, [6]), (0.0, 4, [4, 6])])
def test_last_checkpoint_is_written_at_the_end_not_after_every_validation(minutes, every_n_steps, last_steps, cifar_dir,
                                                                          tmp_path, monkeypatch, capsys):
    written = []
    real_save = loop.save_checkpoint

    def recording(path, state):
        written.append((Path(path).name, state["global_step"]))
        real_save(path, state)

    monkeypatch.setattr(loop, "save_checkpoint", recording)
    args = ["--config", str(REPO / "configs" / "test_tiny.yaml"), "--data-dir", str(cifar_dir), "--cache-dir",
            str(tmp_path / "cache"), "--max-train-images", "64", "--max-test-images", "16", "--set", "val_size=16",
            "--epochs", "3", "--batch-size", "16", "--limit-train-batches", "2", "--limit-val-batches", "1",
            "--limit-test-batches", "1", "--ckpt-every-minutes", str(minutes),
            "--ckpt-every-n-steps", str(every_n_steps), "--out", str(tmp_path / "runs")]
    assert train.main(args) == 0
    run_dir = Path(capsys.readouterr().out.strip().splitlines()[-1])
    lasts = [step for name, step in written if name == "last.ckpt"]
    # three validations, no write of last.ckpt after them; one every N steps and one at the end, step 6
    assert lasts == last_steps
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    assert {name for name, _ in written} == {"last.ckpt", "best.ckpt"}
