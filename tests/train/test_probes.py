"""The optimizer probe: the rule on scripted step times, a real measurement in which a deliberately slow
optimizer loses, and through train.py: the choice printed, recorded in config.yaml, remembered for the next run
and kept by a resumed one."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import yaml

import train
import zoo
from zoo.train import probes
from zoo.train.recipe import resolve_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seconds, expected", [
    ({"muon_conv": 1.05, "muon": 1.02, "adamw": 1.0}, "muon_conv"),   # 0.95x: kept
    ({"muon_conv": 1.20, "muon": 1.05, "adamw": 1.0}, "muon"),        # 0.83x: Muon on the matrices only
    ({"muon_conv": 1.50, "muon": 1.20, "adamw": 1.0}, "adamw"),
    ({"muon_conv": 1.0 / 0.9, "muon": 1.5, "adamw": 1.0}, "muon_conv"),  # exactly the minimum speed
])
def test_affordable_optimizer_keeps_the_first_fast_enough(seconds, expected):
    assert probes.affordable_optimizer(seconds, ("muon_conv", "muon"), 0.9) == expected


@pytest.mark.parametrize("seconds, expected", [
    # the probe's step seconds of vit_tiny (patch dropout 0.75, batch 64) on a 2-core AVX2-only EPYC in fp32, where
    # ten minutes with Muon reached 0.484 and with AdamW 0.290
    ({"muon_conv": 1.013, "muon": 0.999, "adamw": 0.635}, "muon_conv"),
    ({"muon_conv": 2.0, "muon": 2.0, "adamw": 1.0}, "adamw"),  # Muon at half AdamW's speed: not kept
])
def test_the_cpu_recipe_keeps_muon_where_it_was_measured_to_win(seconds, expected):
    recipe = resolve_config("vit_tiny", str(REPO / "configs" / "cpu_budget.yaml"))
    assert probes.affordable_optimizer(seconds, ("muon_conv", "muon"), recipe.optimizer_min_speed) == expected


def test_step_seconds_time_whole_steps_with_each_optimizer():
    class Slow(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.05)
            return super().step(closure)

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 10))
    seconds = probes.optimizer_step_seconds(
        model, torch.randn(4, 3, 2, 2),
        {"slow": lambda m: Slow(m.parameters(), lr=0.1), "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1)},
        "32", repeats=2)
    assert seconds["slow"] > seconds["sgd"] + 0.04
    assert probes.affordable_optimizer({"adamw": seconds["sgd"], **seconds}, ("slow",), 0.9) == "adamw"
    assert all(p.grad is None for p in model.parameters())  # copies trained, not the model


def test_a_model_of_conv_filters_is_measured_without_the_muon_it_cannot_step(tmp_path, monkeypatch):
    """resnet18's weights but its head are filters: muon_conv's fallback muon has no matrix to step, so the probe
    times muon_conv and AdamW only (building muon there raises NothingToStep)."""
    timed = []

    def scripted(model, x, optimizers, precision, **timing):
        timed.append(tuple(optimizers))
        return {"muon_conv": 1.5, "adamw": 1.0}

    monkeypatch.setattr(probes, "optimizer_step_seconds", scripted)
    recipe = probes.Recipe(model="resnet18", optimizer="muon_conv", optimizer_min_speed=0.9, batch_size=2,
                           cache_dir=str(tmp_path))
    assert probes.probe_optimizer(recipe, "32", "float32") == "adamw" and timed == [("muon_conv", "adamw")]


@pytest.mark.parametrize("model", zoo.list_models())
def test_the_cpu_recipe_probes_only_optimizers_that_build_for_every_model(model, tmp_path, monkeypatch):
    def scripted(model, x, optimizers, precision, **timing):
        return {name: 1.0 for name, build in optimizers.items() if build(model) is not None}

    monkeypatch.setattr(probes, "optimizer_step_seconds", scripted)
    recipe = resolve_config(model, REPO / "configs" / "cpu_budget.yaml", ["batch_size=2", f"cache_dir={tmp_path}"])
    assert probes.probe_optimizer(recipe, "32", "float32") == recipe.optimizer  # as fast as AdamW: kept


def test_train_records_the_measured_optimizer_and_a_resumed_run_keeps_it(cifar_dir, tmp_path, capsys, monkeypatch):
    timed = []

    def scripted(model, x, optimizers, precision, **timing):
        timed.append((tuple(optimizers), precision))
        return {"muon_conv": 1.3, "muon": 1.05, "adamw": 1.0}

    monkeypatch.setenv("ZOO_NATIVE_BF16", "0")
    monkeypatch.setattr(probes, "optimizer_step_seconds", scripted)
    cache = tmp_path / "cache"
    args = ["--config", str(REPO / "configs" / "test_tiny.yaml"), "--data-dir", str(cifar_dir), "--cache-dir",
            str(cache), "--max-train-images", "64", "--max-test-images", "16", "--set", "val_size=16", "--epochs", "1",
            "--batch-size", "16", "--limit-train-batches", "1", "--limit-val-batches", "1", "--limit-test-batches", "1",
            "--set", "optimizer=muon_conv", "--set", "optimizer_min_speed=0.9"]
    runs = []
    for i in range(2):
        assert train.main([*args, "--out", str(tmp_path / str(i))]) == 0
        out = capsys.readouterr().out
        assert "optimizer muon_conv (min speed 0.9 of adamw's): muon" in out
        runs.append(Path(out.strip().splitlines()[-1]))
        config = yaml.safe_load((runs[-1] / "config.yaml").read_text())
        assert (config["optimizer"], config["muon_dtype"], config["precision"]) == ("muon", "float32", "32")
    assert timed == [(("muon_conv", "muon", "adamw"), "32")]  # measured once, remembered for the second run

    (cache / probes.PRECISION_FILE).unlink()
    monkeypatch.setattr(probes, "optimizer_step_seconds", lambda *a, **k: pytest.fail("a resumed run measured again"))
    monkeypatch.setenv("ZOO_NATIVE_BF16", "1")  # another machine: the run keeps the choices it started with
    assert train.main([*args, "--out", str(tmp_path / "0"), "--resume", str(runs[0]), "--epochs", "2"]) == 0
    capsys.readouterr()
    ckpt = torch.load(runs[0] / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["hyper_parameters"]["optimizer"] == "muon" and ckpt["hyper_parameters"]["muon_dtype"] == "float32"
    assert ckpt["global_step"] == 2


def test_the_probes_time_a_small_batch_of_the_largest_step_the_run_takes(cifar_dir, tmp_path, capsys, monkeypatch):
    """A batch_size above the training set is one step of the whole set: the probes time at most PROBE_BATCH
    images of it and scale the passes to it, not batch_size random images (for --batch-size 100000 those took all
    of a 24 GiB machine's memory before the first step; at batch 256 the probes took minutes on a 2-core CPU)."""
    seen = []

    def optimizer_seconds(model, x, optimizers, precision, **timing):
        seen.append(("optimizer", x.shape[0], timing["batch_scale"] * x.shape[0]))
        return dict.fromkeys(optimizers, 1.0)

    def faster(model, x, precisions, *args, **kwargs):
        seen.append(("precision", x.shape[0]))
        return "32"

    monkeypatch.setenv("ZOO_NATIVE_BF16", "1")  # --precision auto measures on a CPU with native bf16
    monkeypatch.setattr(probes, "optimizer_step_seconds", optimizer_seconds)
    monkeypatch.setattr(probes, "faster_precision", faster)
    args = ["--config", str(REPO / "configs" / "test_tiny.yaml"), "--data-dir", str(cifar_dir), "--cache-dir",
            str(tmp_path / "cache"), "--max-train-images", "64", "--max-test-images", "16", "--set", "val_size=16",
            "--epochs", "1", "--limit-val-batches", "1", "--limit-test-batches", "1", "--precision", "auto",
            "--set", "optimizer=muon_conv", "--set", "optimizer_min_speed=0.9", "--out", str(tmp_path / "runs")]
    assert train.main([*args, "--batch-size", "100000"]) == 0, capsys.readouterr().err[-2000:]
    assert probes.PROBE_BATCH == 32
    # the training images, all but val_size: 48 in a step, 32 of them timed
    assert seen == [("precision", 32), ("optimizer", 32, 64 - 16)]
    seen.clear()
    assert train.main([*args, "--batch-size", "16", "--limit-train-batches", "1"]) == 0
    assert seen == [("precision", 16), ("optimizer", 16, 16)]


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
