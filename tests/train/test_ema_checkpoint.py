"""With an EMA of the weights, the test in train.py scores the averaged weights: the ones validation chose the
best checkpoint by and that load_run / eval.py / publish read from it (the trained weights beside them serve only
a resume). Checked on a short real run against eval.py's plain
cross-entropy on the same test images, and against the raw weights, which must score differently."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from zoo.data.run_data import data_for_run
from zoo.models import load_run
from zoo.models.checkpoints import load_checkpoint


@pytest.fixture(scope="module")
def ema_run(cifar_dir, tmp_path_factory, run_train):
    root = tmp_path_factory.mktemp("ema_runs")
    cmd = ["--model", "vit_nano", "--data-dir", str(cifar_dir), "--epochs", "1",
           "--max-train-images", "256", "--max-test-images", "64", "--limit-train-batches", "6",
           "--limit-val-batches", "1", "--batch-size", "32", "--lr", "0.01", "--set", "val_size=32",
           "--set", "ema_decay=0.5", "--set", "label_smoothing=0.0", "--set", "tta=0", "--set", "warmup_epochs=0",
           "--out", str(root), "--cache-dir", str(root / "cache")]
    done = run_train(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = (root / "vit_nano").iterdir()
    return run


def _cross_entropy(model, dm) -> float:
    images, labels = dm.test_dataset.images, dm.test_dataset.labels
    with torch.no_grad():
        return F.cross_entropy(model(dm.normalize(images)), labels).item()


def test_the_test_scores_the_averaged_weights(ema_run):
    summary = json.loads((ema_run / "summary.json").read_text())
    model, meta = load_run(ema_run)  # best.ckpt's state_dict: the EMA weights
    dm = data_for_run(meta, max_test_images=64)
    assert summary["test_loss_smoothed"] == pytest.approx(_cross_entropy(model, dm), rel=1e-4)
    ckpt = load_checkpoint(ema_run / "checkpoints" / summary["tested_checkpoint"])
    raw = {k.removeprefix("model."): v for k, v in ckpt["trained_state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(raw)
    assert _cross_entropy(model, dm) != pytest.approx(summary["test_loss_smoothed"], rel=1e-3)
