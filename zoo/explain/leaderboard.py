"""The faithfulness leaderboard of one model: every applicable explanation method (``methods``) scored by
deletion and insertion AUC under each chosen removal (``perturbation``), with bootstrap 95% CIs and the one-sided
paired tests against the random map, against rollout and against the best of the baselines (random, centre,
edges) on the same images, as rows of ``faithfulness.csv``.

The points of a curve where no patch or every patch is removed are the same for every method (the image itself,
or the image with everything removed), so they are scored once per removal and shared."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_write_csv
from .methods import BASELINES, applicable_methods, attribute
from .perturbation import (
    FRACTIONS,
    METRICS,
    auc,
    bootstrap_ci,
    faithfulness_summary,
    paired_auc_p_value,
    perturbation_curves,
)
from .progress import Progress, counted

COLUMNS = ("model", "method", "removal", "metric", "auc", "ci_low", "ci_high", "p_vs_random", "p_vs_rollout",
           "num_images", "p_vs_baselines")
WITHOUT_BASELINES = COLUMNS[:-1]  # faithfulness.csv before p_vs_baselines
EARLIER_COLUMNS = tuple(c for c in WITHOUT_BASELINES if c != "p_vs_rollout")  # ... and before p_vs_rollout
BEATS_BASELINES_P = 0.01  # faithfulness.md flags a method whose p_vs_baselines is not below this


def method_heatmaps(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *,
                    methods: Sequence[str] | None = None, grid: int = 8, batch_size: int = 256, seed: int = 0,
                    progress: bool = False) -> dict[str, torch.Tensor]:
    """{method: heatmaps (B, gh, gw)} explaining ``labels`` for every method in ``methods`` (default every one
    that applies), with the baselines ``BASELINES`` always last ("random" and "centre" on a ``grid`` x ``grid``
    grid), computed in batches."""
    device = next(model.parameters()).device
    methods = [m for m in (methods or applicable_methods(model)) if m not in BASELINES] + list(BASELINES)
    heatmaps = {}
    for method in counted(methods, total=len(methods), desc=f"explaining {len(images):,} images",
                          unit="methods", enabled=progress):
        options = (dict(grid=(grid, grid), seed=seed) if method == "random" else
                   dict(grid=(grid, grid)) if method == "centre" else {})
        heatmaps[method] = torch.cat([
            attribute(model, images[i:i + batch_size].to(device), method, labels[i:i + batch_size].to(device),
                      **options) for i in range(0, len(images), batch_size)])
    return heatmaps


def faithfulness_curves(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                        heatmaps: dict[str, torch.Tensor], *, removals: Sequence[str] = ("zero",),
                        metrics: Sequence[str] = METRICS, fractions: Sequence[float] = FRACTIONS, grid: int = 8,
                        batch_size: int = 256, seed: int = 0,
                        progress: bool = False) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """{(removal, metric): {method: per-image curves (B, F)}} of ``perturbation_curves`` for every heatmap. The
    fractions that remove no patch or every patch are scored once per removal and shared by all methods."""
    cells = grid * grid
    inner = [j for j, f in enumerate(fractions) if 0 < round(f * cells) < cells]
    options = dict(fractions=[fractions[j] for j in inner], grid=grid, batch_size=batch_size, seed=seed)
    any_map = next(iter(heatmaps.values()))
    found = {}
    bar = Progress(total=len(removals) * len(metrics) * len(heatmaps), desc=f"perturbing {len(images):,} images",
                   unit="curves", enabled=progress)
    for removal in removals:
        # column 0: nothing removed, column 1: everything removed (deletion of fractions 0 and 1)
        ends = perturbation_curves(model, images, labels, any_map, metric="deletion", removal=removal,
                                   fractions=(0.0, 1.0), grid=grid, batch_size=batch_size, seed=seed)
        for metric in metrics:
            found[removal, metric] = {}
            for method, heatmap in heatmaps.items():
                curves = torch.empty(len(images), len(fractions))
                for j, f in enumerate(fractions):
                    removes_all = (round(f * cells) == cells) == (metric == "deletion")
                    curves[:, j] = ends[:, int(removes_all)]
                if inner:
                    curves[:, inner] = perturbation_curves(model, images, labels, heatmap, metric=metric,
                                                           removal=removal, **options)
                found[removal, metric][method] = curves
                bar.update()
    bar.close()
    return found


def rows_from_curves(curves: dict[tuple[str, str], dict[str, torch.Tensor]], *, model_name: str,
                     fractions: Sequence[float] = FRACTIONS, seed: int = 0) -> list[dict]:
    """One row (``COLUMNS``) per (removal, metric) and method of ``faithfulness_curves``' result; "random" is the
    baseline every p_vs_random is paired against (its own is NaN), and "rollout", where the model has it, the one
    every other method's p_vs_rollout is paired against (NaN for rollout, random and models without rollout);
    p_vs_baselines pairs each method that is not a baseline against the baseline of ``BASELINES`` with the best
    mean AUC in that column (NaN for the baselines themselves)."""
    rows = []
    for (removal, metric), by_method in curves.items():
        baselines = [b for b in BASELINES if b in by_method]
        sign = 1 if metric == "deletion" else -1
        strongest = min(baselines, key=lambda b: sign * auc(fractions, by_method[b]).mean().item())
        for method, curve in by_method.items():
            summary = faithfulness_summary(fractions, curve, by_method["random"], metric=metric, seed=seed)
            if method == "random":
                summary["p_vs_random"] = math.nan
            summary["p_vs_rollout"] = (
                paired_auc_p_value(fractions, curve, by_method["rollout"], metric=metric, seed=seed)
                if "rollout" in by_method and method not in ("rollout", "random") else math.nan)
            summary["p_vs_baselines"] = (math.nan if method in BASELINES else paired_auc_p_value(
                fractions, curve, by_method[strongest], metric=metric, seed=seed))
            rows.append({"model": model_name, "method": method, "removal": removal, "metric": metric, **summary})
    return rows


def faithfulness_rows(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, model_name: str,
                      methods: Sequence[str] | None = None, removals: Sequence[str] = ("zero",),
                      metrics: Sequence[str] = METRICS, fractions: Sequence[float] = FRACTIONS, grid: int = 8,
                      batch_size: int = 256, seed: int = 0) -> list[dict]:
    """One row (``COLUMNS``) per method x removal x metric for ``model`` (eval mode) on normalised ``images``
    (B, C, H, W) with true ``labels`` (B,): the class every method explains and every curve scores.
    ``methods``: default every one that applies (``applicable_methods``); "random" is always scored, as the
    baseline (its own p_vs_random is NaN). Heatmaps are computed in batches of ``batch_size``."""
    heatmaps = method_heatmaps(model, images, labels, methods=methods, grid=grid, batch_size=batch_size, seed=seed)
    curves = faithfulness_curves(model, images, labels, heatmaps, removals=removals, metrics=metrics,
                                 fractions=fractions, grid=grid, batch_size=batch_size, seed=seed)
    return rows_from_curves(curves, model_name=model_name, fractions=fractions, seed=seed)


def curve_bands(curves: dict[tuple[str, str], dict[str, torch.Tensor]], *,
                seed: int = 0) -> dict[tuple[str, str], dict[str, tuple]]:
    """{(removal, metric): {method: (mean, ci_low, ci_high)}}, each a list over the fractions: the mean curve
    over images and its percentile bootstrap 95% interval at each fraction (for the figures)."""
    bands = {}
    for key, by_method in curves.items():
        bands[key] = {}
        for method, curve in by_method.items():
            low, high = zip(*(bootstrap_ci(curve[:, j], seed=seed) for j in range(curve.shape[1])), strict=True)
            bands[key][method] = (curve.mean(dim=0).tolist(), list(low), list(high))
    return bands


def best_rows(rows: Iterable[dict]) -> dict[tuple[str, str, str], dict]:
    """{(model, removal, metric): the row of the best method other than the baselines} (deletion: lowest AUC,
    insertion: highest)."""
    best = {}
    for row in rows:
        if row["method"] in BASELINES:
            continue
        key = row["model"], row["removal"], row["metric"]
        sign = 1 if row["metric"] == "deletion" else -1
        if key not in best or sign * row["auc"] < sign * best[key]["auc"]:
            best[key] = row
    return best


def best_method(rows: Iterable[dict], model: str) -> dict | None:
    """``model``'s headline method: the best by deletion AUC under zero removal (else under the first removal
    its rows have), or None when the rows hold no method but random for it."""
    best = {k: r for k, r in best_rows(rows).items() if k[0] == model and k[2] == "deletion"}
    return best.get((model, "zero", "deletion")) or next(iter(best.values()), None)


def write_csv(rows: Iterable[dict], path: str | Path) -> None:
    atomic_write_csv(path, COLUMNS, rows, restval="nan")  # a p value a row lacks: NaN


def read_csv(path: str | Path) -> list[dict]:
    """The rows of a faithfulness.csv, numbers as numbers (one written before p_vs_rollout or p_vs_baselines
    existed gets NaN there); a file with other columns -> ValueError."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) not in (COLUMNS, WITHOUT_BASELINES, EARLIER_COLUMNS):
            raise ValueError(f"{path} is not a faithfulness.csv: expected the columns {', '.join(COLUMNS)}, got "
                             f"{', '.join(reader.fieldnames or ())}")
        rows = list(reader)
    for row in rows:
        row.setdefault("p_vs_rollout", "nan")
        row.setdefault("p_vs_baselines", "nan")
        row |= {k: float(row[k]) for k in ("auc", "ci_low", "ci_high", "p_vs_random", "p_vs_rollout",
                                           "p_vs_baselines")}
        row["num_images"] = int(row["num_images"])
    return rows
