"""The faithfulness leaderboard's rows on an untrained hybrid: bookkeeping only (every method, removal and metric
once, CIs around the mean, random as the baseline, the CSV's columns); an untrained model's AUCs mean nothing.
The statistics themselves are tested against known answers in test_perturbation.py."""

from __future__ import annotations

import csv
import math

import torch

import zoo
from zoo.explain.leaderboard import COLUMNS, faithfulness_rows, write_csv


def test_rows_cover_every_applicable_method_removal_and_metric(tmp_path):
    model = zoo.create_model("hybrid_tiny").eval()
    images, labels = torch.randn(6, 3, 32, 32), torch.arange(6)
    rows = faithfulness_rows(model, images, labels, model_name="hybrid_tiny", removals=("zero", "mean"),
                             fractions=(0.0, 0.5, 1.0), batch_size=4)
    assert len(rows) == 7 * 2 * 2
    assert {r["method"] for r in rows} == set(zoo.explain.METHODS)
    for row in rows:
        assert row["num_images"] == 6 and row["ci_low"] <= row["auc"] <= row["ci_high"]
        assert math.isnan(row["p_vs_random"]) == (row["method"] == "random")
    write_csv(rows, tmp_path / "faithfulness.csv")
    with open(tmp_path / "faithfulness.csv") as f:
        read = list(csv.DictReader(f))
    assert tuple(read[0]) == COLUMNS and len(read) == len(rows)


def test_shared_end_points_equal_scoring_every_fraction():
    """Where no patch or every patch is removed the curve is the same for every method: scored once, shared."""
    from zoo.explain.leaderboard import faithfulness_curves, method_heatmaps
    from zoo.explain.perturbation import FRACTIONS, perturbation_curves

    model = zoo.create_model("vit_nano").eval()
    images, labels = torch.randn(5, 3, 32, 32), torch.arange(5)
    heatmaps = method_heatmaps(model, images, labels, methods=["rollout", "chefer2021"])
    assert list(heatmaps) == ["rollout", "chefer2021", "random"]
    curves = faithfulness_curves(model, images, labels, heatmaps, removals=("zero", "blur"), batch_size=16)
    for (removal, metric), by_method in curves.items():
        for method, curve in by_method.items():
            direct = perturbation_curves(model, images, labels, heatmaps[method], metric=metric, removal=removal,
                                         fractions=FRACTIONS, batch_size=7)
            torch.testing.assert_close(curve, direct, atol=1e-6, rtol=0)


def test_best_method_and_csv_round_trip(tmp_path):
    from zoo.explain.leaderboard import best_method, best_rows, read_csv

    def row(method, removal, metric, auc):
        return {"model": "m", "method": method, "removal": removal, "metric": metric, "auc": auc,
                "ci_low": auc - 0.01, "ci_high": auc + 0.01, "p_vs_random": math.nan if method == "random" else 0.01,
                "num_images": 10}

    rows = [row("random", "zero", "deletion", 0.1), row("rollout", "zero", "deletion", 0.3),
            row("gradcam", "zero", "deletion", 0.2), row("rollout", "zero", "insertion", 0.6),
            row("gradcam", "zero", "insertion", 0.5), row("rollout", "blur", "deletion", 0.1)]
    best = best_rows(rows)
    assert best["m", "zero", "deletion"]["method"] == "gradcam"  # lowest deletion AUC; random never wins
    assert best["m", "zero", "insertion"]["method"] == "rollout"  # highest insertion AUC
    assert best_method(rows, "m")["method"] == "gradcam"  # the zero-removal deletion column is the headline
    assert best_method(rows, "other") is None
    write_csv(rows, tmp_path / "faithfulness.csv")
    read = read_csv(tmp_path / "faithfulness.csv")
    assert read[2]["auc"] == 0.2 and read[2]["num_images"] == 10 and math.isnan(read[0]["p_vs_random"])
