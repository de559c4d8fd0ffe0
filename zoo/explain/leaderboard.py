"""The faithfulness leaderboard of one model: every applicable explanation method (``methods``) scored by
deletion and insertion AUC under each chosen removal (``perturbation``), with bootstrap 95% CIs and the one-sided
paired test against the random map on the same images, as rows of ``faithfulness.csv``."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from .methods import applicable_methods, attribute
from .perturbation import FRACTIONS, METRICS, faithfulness_summary, perturbation_curves

COLUMNS = ("model", "method", "removal", "metric", "auc", "ci_low", "ci_high", "p_vs_random", "num_images")


def faithfulness_rows(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, model_name: str,
                      methods: Sequence[str] | None = None, removals: Sequence[str] = ("zero",),
                      metrics: Sequence[str] = METRICS, fractions: Sequence[float] = FRACTIONS, grid: int = 8,
                      batch_size: int = 256, seed: int = 0) -> list[dict]:
    """One row (``COLUMNS``) per method x removal x metric for ``model`` (eval mode) on normalised ``images``
    (B, C, H, W) with true ``labels`` (B,): the class every method explains and every curve scores.
    ``methods``: default every one that applies (``applicable_methods``); "random" is always scored, as the
    baseline (its own p_vs_random is NaN). Heatmaps are computed in batches of ``batch_size``."""
    device = next(model.parameters()).device
    methods = [m for m in (methods or applicable_methods(model)) if m != "random"] + ["random"]
    heatmaps = {}
    for method in methods:
        options = dict(grid=(grid, grid), seed=seed) if method == "random" else {}
        heatmaps[method] = torch.cat([
            attribute(model, images[i:i + batch_size].to(device), method, labels[i:i + batch_size].to(device),
                      **options) for i in range(0, len(images), batch_size)])
    rows = []
    for removal in removals:
        for metric in metrics:
            curves = {method: perturbation_curves(model, images, labels, heatmap, metric=metric, removal=removal,
                                                  fractions=fractions, grid=grid, batch_size=batch_size, seed=seed)
                      for method, heatmap in heatmaps.items()}
            for method, curve in curves.items():
                summary = faithfulness_summary(fractions, curve, curves["random"], metric=metric, seed=seed)
                if method == "random":
                    summary["p_vs_random"] = math.nan
                rows.append({"model": model_name, "method": method, "removal": removal, "metric": metric,
                             **summary})
    return rows


def write_csv(rows: Iterable[dict], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
