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
