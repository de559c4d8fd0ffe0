"""What a run measures before it trains: the seconds of a whole step with each optimizer (its estimate), the
precision ``auto`` chooses where bf16 is native (remembered, and kept by a resumed run, with the Muon dtype), timed on
a small batch of the largest step the run takes; and what it no longer measures: the recipe names its optimizer, and
no timing swaps it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import yaml

import train
from zoo.train import probes

REPO = Path(__file__).resolve().parents[2]
TINY_RUN = ["--config", str(REPO / "configs" / "test_tiny.yaml"), "--max-train-images", "64", "--max-test-images",
            "16", "--set", "val_size=16", "--limit-val-batches", "1", "--limit-test-batches", "1"]


def test_step_seconds_time_whole_steps_with_each_optimizer():
    class Slow(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.05)
            return super().step(closure)

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 10))
    seconds = probes.timed_step_seconds(
        model, torch.randn(4, 3, 2, 2),
        {"slow": lambda m: Slow(m.parameters(), lr=0.1), "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1)},
        "32", repeats=2)
    assert seconds["slow"] > seconds["sgd"] + 0.04
    assert all(p.grad is None for p in model.parameters())  # copies trained, not the model


def test_the_recipe_names_its_optimizer_and_no_probe_swaps_it(cifar_dir, tmp_path, capsys):
    args = [*TINY_RUN, "--data-dir", str(cifar_dir), "--cache-dir", str(tmp_path / "cache"), "--epochs", "1",
            "--batch-size", "16", "--limit-train-batches", "1", "--precision", "32", "--set", "optimizer=muon_conv"]
    assert train.main([*args, "--out", str(tmp_path / "runs")]) == 0
    run = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"] == "muon_conv"
    assert train.main([*args, "--set", "optimizer_min_speed=0.6", "--out", str(tmp_path / "other")]) == 2
    assert "unknown config key 'optimizer_min_speed'" in capsys.readouterr().err


def test_train_records_the_measured_precision_and_a_resumed_run_keeps_it(cifar_dir, tmp_path, capsys, monkeypatch):
    """On a CPU with native bf16, --precision auto measures once (remembered for the next run of the recipe) and
    config.yaml records the choice and the Muon dtype; a resume on another machine keeps them."""
    measured = []

    def faster(model, x, precisions, *args, **kwargs):
        measured.append(precisions)
        return "bf16-mixed"

    monkeypatch.setenv("ZOO_NATIVE_BF16", "1")
    monkeypatch.setattr(probes, "faster_precision", faster)
    cache = tmp_path / "cache"
    args = [*TINY_RUN, "--data-dir", str(cifar_dir), "--cache-dir", str(cache), "--epochs", "1", "--batch-size", "16",
            "--limit-train-batches", "1", "--set", "optimizer=muon"]
    runs = []
    for i in range(2):
        assert train.main([*args, "--out", str(tmp_path / str(i))]) == 0
        out = capsys.readouterr().out
        assert "--precision auto: bf16-mixed for hybrid_tiny on this CPU" in out
        runs.append(Path(out.strip().splitlines()[-1]))
        config = yaml.safe_load((runs[-1] / "config.yaml").read_text())
        assert (config["optimizer"], config["muon_dtype"], config["precision"]) == ("muon", "bfloat16", "bf16-mixed")
    assert measured == [("32", "bf16-mixed")]  # measured once, remembered for the second run

    (cache / probes.PRECISION_FILE).unlink()
    monkeypatch.setattr(probes, "faster_precision", lambda *a, **k: pytest.fail("a resumed run measured again"))
    monkeypatch.setenv("ZOO_NATIVE_BF16", "0")  # another machine: the run keeps the choices it started with
    assert train.main([*args, "--out", str(tmp_path / "0"), "--resume", str(runs[0]), "--epochs", "2"]) == 0
    capsys.readouterr()
    ckpt = torch.load(runs[0] / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["hyper_parameters"]["optimizer"] == "muon" and ckpt["hyper_parameters"]["muon_dtype"] == "bfloat16"
    assert ckpt["global_step"] == 2


def test_the_probes_time_a_small_batch_of_the_largest_step_the_run_takes(cifar_dir, tmp_path, capsys, monkeypatch):
    """A batch_size above the training set is one step of the whole set: the probes time at most PROBE_BATCH
    images of it and scale the passes to it, not batch_size random images (for --batch-size 100000 those took all
    of a 24 GiB machine's memory before the first step; at batch 256 the probes took minutes on a 2-core CPU)."""
    seen = []

    def step_seconds(model, x, optimizers, precision, **timing):
        seen.append(("step", x.shape[0], timing["batch_scale"] * x.shape[0]))
        return dict.fromkeys(optimizers, 1.0)

    def faster(model, x, precisions, *args, **kwargs):
        seen.append(("precision", x.shape[0]))
        return "32"

    monkeypatch.setenv("ZOO_NATIVE_BF16", "1")  # --precision auto measures on a CPU with native bf16
    monkeypatch.setattr(probes, "timed_step_seconds", step_seconds)
    monkeypatch.setattr(probes, "faster_precision", faster)
    args = [*TINY_RUN, "--data-dir", str(cifar_dir), "--cache-dir", str(tmp_path / "cache"), "--epochs", "1",
            "--precision", "auto", "--set", "optimizer=muon_conv", "--out", str(tmp_path / "runs")]
    assert train.main([*args, "--batch-size", "100000"]) == 0, capsys.readouterr().err[-2000:]
    assert probes.PROBE_BATCH == 32
    # the training images, all but val_size: 48 in a step, 32 of them timed
    assert seen == [("precision", 32), ("step", 32, 64 - 16)]
    seen.clear()
    assert train.main([*args, "--batch-size", "16", "--limit-train-batches", "1"]) == 0
    assert seen == [("precision", 16), ("step", 16, 16)]


def test_step_seconds_scale_the_passes_to_the_runs_batch_and_not_the_optimizer_step():
    """A forward of a fixed 0.03 s and an optimizer step of a fixed 0.03 s: a step of 4x the timed batch costs
    3 forward passes more, and its optimizer step the same (sleeps only lengthen on a busy machine: bounds from
    below)."""
    class Slow(torch.nn.Linear):
        def forward(self, x):
            time.sleep(0.03)
            return super().forward(x.flatten(1))

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.03)
            return super().step(closure)

    model, x = Slow(12, 10), torch.randn(4, 3, 2, 2)
    builds = {"sgd": lambda m: SlowSGD(m.parameters(), lr=0.1)}
    one = probes.timed_step_seconds(model, x, builds, "32", repeats=1)["sgd"]
    four = probes.timed_step_seconds(model, x, builds, "32", repeats=1, batch_scale=4.0)["sgd"]
    assert one >= 0.03 + 0.03 and four >= 4 * 0.03 + 0.03
