"""Checkpoint writes out of the measured step: training throughput leaves out the seconds the checkpoint writer
spent (a scripted clock), and last.ckpt is written on a wall-clock interval and at the end, not after every
validation (the writes of a real run counted)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train
from zoo.train import callbacks, runs

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_throughput_leaves_out_checkpoint_writes(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(callbacks.time, "perf_counter", clock)
    monkeypatch.setattr(runs.time, "perf_counter", clock)

    def slow_write(path, write):  # a checkpoint write that takes 10 scripted seconds
        clock.now += 10.0

    monkeypatch.setattr(runs, "atomic_write", slow_write)
    io = runs.AtomicCheckpointIO()
    throughput = callbacks.Throughput(io)
    trainer, module = SimpleNamespace(world_size=1), SimpleNamespace(device=torch.device("cpu"))
    batch = (torch.zeros(8, 1), torch.zeros(8))
    throughput.on_train_epoch_start(trainer, module)
    for i in range(4):
        clock.now += 1.0  # one training step: 1 s
        throughput.on_train_batch_end(trainer, module, None, batch, i)
        if i == 1:
            io.save_checkpoint({}, tmp_path / "last.ckpt")  # an interval checkpoint between steps
    throughput.on_validation_start(trainer, module)
    clock.now += 5.0  # validation
    throughput.on_validation_end(trainer, module)
    io.save_checkpoint({}, tmp_path / "best.ckpt")  # written after validation, on the training clock
    clock.now += 1.0
    throughput.on_train_batch_end(trainer, module, None, batch, 4)
    throughput.on_train_epoch_end(trainer, module)
    assert io.write_seconds == 20.0
    assert throughput.train_s == pytest.approx(5.0)
    assert throughput.images_per_s == pytest.approx(40 / 5.0)
    assert throughput.later_images_per_s is None  # one epoch: nothing after the first
    throughput.on_train_epoch_start(trainer, module)  # a second epoch: 2 steps of 0.5 s
    for i in range(2):
        clock.now += 0.5
        throughput.on_train_batch_end(trainer, module, None, batch, i)
    throughput.on_train_epoch_end(trainer, module)
    assert throughput.later_images_per_s == pytest.approx(16 / 1.0)
    assert throughput.images_per_s == pytest.approx(56 / 6.0)


@pytest.mark.parametrize("minutes, every_n_steps, last_steps", [(60.0, 500, [6]), (0.0, 500, [6]), (0.0, 4, [4, 6])])
def test_last_checkpoint_is_written_at_the_end_not_after_every_validation(minutes, every_n_steps, last_steps, cifar_dir,
                                                                          tmp_path, monkeypatch, capsys):
    written = []
    save = runs.AtomicCheckpointIO.save_checkpoint

    def recording(self, checkpoint, path, storage_options=None):
        written.append((Path(path).name, checkpoint["global_step"]))
        save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(runs.AtomicCheckpointIO, "save_checkpoint", recording)
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
