"""train.py --logger: a run with TensorBoard writes event files whose scalars are metrics.csv's, read back with
TensorBoard's own event reader; a logger whose package is missing, or an unknown one, is one line naming the fix
and exit code 2 before any data is read; metrics.csv is always written."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

from zoo.train.recipe import Recipe

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import train  # noqa: E402


def csv_scalars(path: Path) -> list[tuple[str, int, float]]:
    """(metric, step, value) of every filled cell of metrics.csv, sorted."""
    with path.open(newline="") as f:
        return sorted((key, int(float(row["step"])), float(value)) for row in csv.DictReader(f)
                      for key, value in row.items() if key != "step" and value != "")


def tensorboard_scalars(folder: Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the event files under ``folder``, sorted."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})   # 0: keep every event
    events.Reload()
    return sorted((tag, e.step, e.value) for tag in events.Tags()["scalars"] for e in events.Scalars(tag))


def test_tensorboard_logs_the_scalars_of_metrics_csv(cifar_dir, tmp_path, capsys):
    code = train.main(["--model", "vit_nano", "--logger", "tensorboard", "--out", str(tmp_path),
                       "--data-dir", str(cifar_dir), "--cache-dir", str(tmp_path / "cache"),
                       "--max-train-images", "200", "--max-test-images", "32", "--set", "val_size=32",
                       "--epochs", "2", "--batch-size", "16", "--limit-train-batches", "3", "--limit-val-batches", "1",
                       "--ckpt-every-n-steps", "1"])   # a training-step row every step (log_every_n_steps)
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    run_dir = Path(out.strip().splitlines()[-1])
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    expected, logged = csv_scalars(run_dir / "metrics.csv"), tensorboard_scalars(run_dir / "tensorboard")
    tags = {key for key, _, _ in expected}
    assert {"train/loss_step", "val/top1", "test/top1", "epoch"} <= tags and len(expected) > 20
    assert [(key, step) for key, step, _ in logged] == [(key, step) for key, step, _ in expected]
    # event files store float32: equal to the CSV's value up to float32 rounding
    assert [value for _, _, value in logged] == pytest.approx([value for _, _, value in expected], rel=1e-6, abs=1e-7)


def test_a_missing_logger_package_is_one_line_before_any_data_is_read(cifar_dir, tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "wandb" else
                        find_spec(name, *args))
    code = train.main(["--model", "vit_nano", "--logger", "csv,tensorboard", "--logger", "wandb",
                       "--out", str(tmp_path / "runs"),
                       "--data-dir", str(cifar_dir), "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "pip install wandb" in err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "runs").exists()


def test_logger_names_are_checked_and_csv_is_always_on(tmp_path, capsys):
    assert Recipe.from_dict({"loggers": "TensorBoard, csv,tensorboard"}).loggers == ["tensorboard"]
    assert Recipe.from_dict({"loggers": ["csv"]}).loggers == []
    code = train.main(["--model", "vit_nano", "--logger", "tensorbord", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "tensorbord" in err and "tensorboard" in err and len(err.strip().splitlines()) == 1
