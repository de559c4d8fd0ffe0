"""One real learning check: the test-only tiny ViT (configs/test_tiny.yaml) trained for about a minute on
5,000 real CIFAR-10 images, with --max-time fitting its schedule, reaches >= 30% top-1 on 1,000 held-out
real test images (chance is 10%)."""

from __future__ import annotations

import json
import subprocess
import sys

from zoo.config import CONFIG_DIR


def test_tiny_vit_learns_real_cifar10_in_a_minute(cifar_dir, tmp_path):
    cmd = [sys.executable, str(CONFIG_DIR.parent / "train.py"),
           "--config", str(CONFIG_DIR / "test_tiny.yaml"),
           "--data-dir", str(cifar_dir), "--cache-dir", str(tmp_path / "cache"), "--max-train-images", "5500",
           "--max-test-images", "1000", "--epochs", "30", "--max-time", "00:00:01:00",
           "--out", str(tmp_path / "runs")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / done.stdout.strip().splitlines()[-1] / "summary.json").read_text())
    assert summary["test_top1"] >= 0.30, summary
    assert summary["global_step"] > 0 and summary["wall_time_s"] < 75
