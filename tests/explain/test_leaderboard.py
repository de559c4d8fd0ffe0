"""The faithfulness leaderboard's rows on an untrained hybrid: bookkeeping only (every method, removal and metric
once, CIs around the mean, random as the baseline, the CSV's columns); an untrained model's AUCs mean nothing.
The statistics themselves are tested against known answers in test_perturbation.py."""

from __future__ import annotations

import csv
import math

import pytest
import torch

import zoo
from zoo.explain.leaderboard import COLUMNS, faithfulness_rows, write_csv


def test_rows_cover_every_applicable_method_removal_and_metric(tmp_path):
    model = zoo.create_model("hybrid_tiny").eval()
    images, labels = torch.randn(6, 3, 32, 32), torch.arange(6)
    rows = faithfulness_rows(model, images, labels, model_name="hybrid_tiny", removals=("zero", "mean"),
                             fractions=(0.0, 0.5, 1.0), batch_size=4)
    assert len(rows) == 10 * 2 * 2
    assert {r["method"] for r in rows} == set(zoo.explain.METHODS)
    for row in rows:
        assert row["num_images"] == 6 and row["ci_low"] <= row["auc"] <= row["ci_high"]
        assert math.isnan(row["p_vs_random"]) == (row["method"] == "random")
        assert math.isnan(row["p_vs_rollout"]) == (row["method"] in ("rollout", "random"))
        assert math.isnan(row["p_vs_baselines"]) == (row["method"] in ("random", "centre", "edges"))
    write_csv(rows, tmp_path / "faithfulness.csv")
    with open(tmp_path / "faithfulness.csv") as f:
        read = list(csv.DictReader(f))
    assert tuple(read[0]) == COLUMNS and len(read) == len(rows)


def test_shared_end_points_equal_scoring_every_fraction():
    """Where no patch or every patch is removed the curve is the same for every method: scored once, shared."""
    from zoo.explain.leaderboard import faithfulness_curves, method_heatmaps
    from zoo.explain.perturbation import FRACTIONS, perturbation_curves

    model = zoo.create_model("vit_nano").eval()
    images, labels = torch.randn(3, 3, 32, 32), torch.arange(3)
    heatmaps = method_heatmaps(model, images, labels, methods=["rollout"])
    assert list(heatmaps) == ["rollout", "random", "centre", "edges"]
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
                "p_vs_rollout": math.nan if method in ("random", "rollout") else 0.02, "num_images": 10,
                "p_vs_baselines": math.nan if method == "random" else 0.03}

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
    assert read[2]["p_vs_rollout"] == 0.02 and math.isnan(read[1]["p_vs_rollout"])
    assert read[2]["p_vs_baselines"] == 0.03 and math.isnan(read[0]["p_vs_baselines"])


def test_a_csv_from_before_p_vs_rollout_still_reads(tmp_path):
    from zoo.explain.leaderboard import EARLIER_COLUMNS, read_csv

    path = tmp_path / "faithfulness.csv"
    path.write_text(",".join(EARLIER_COLUMNS) + "\nm,chefer2021,zero,deletion,0.2,0.19,0.21,0.001,1000\n")
    (row,) = read_csv(path)
    assert row["p_vs_random"] == 0.001 and math.isnan(row["p_vs_rollout"]) and row["num_images"] == 1000
    assert math.isnan(row["p_vs_baselines"])
    path.write_text("model,method,auc\nm,rollout,0.2\n")
    with pytest.raises(ValueError, match="is not a faithfulness.csv: expected the columns"):
        read_csv(path)


@pytest.mark.parametrize("metric", ["deletion", "insertion"])
def test_p_vs_rollout_equals_scipys_exact_paired_permutation_test(metric):
    """p_vs_rollout against scipy's exact sign-flip test on the per-image AUC differences (12 images: 4,096
    sign patterns, so scipy enumerates them all while ours samples 10,000)."""
    stats = pytest.importorskip("scipy.stats")
    from zoo.explain.leaderboard import rows_from_curves
    from zoo.explain.perturbation import auc

    fractions = (0.0, 0.5, 1.0)
    generator = torch.Generator().manual_seed(3)
    curves = {m: torch.rand(12, 3, generator=generator, dtype=torch.float64)
              for m in ("rollout", "chefer2021", "random")}
    curves["chefer2021"] = curves["rollout"] + (0.08 if metric == "insertion" else -0.08) * torch.rand(
        12, 3, generator=generator, dtype=torch.float64) + 0.05 * torch.randn(12, 3, generator=generator,
                                                                                dtype=torch.float64)
    rows = {r["method"]: r for r in rows_from_curves({("zero", metric): curves}, model_name="m",
                                                     fractions=fractions)}
    gain = auc(fractions, curves["chefer2021"]) - auc(fractions, curves["rollout"])
    gain = gain if metric == "insertion" else -gain  # "beats rollout" = a positive gain
    exact = stats.permutation_test((gain.numpy(),), lambda d: d.mean(), permutation_type="samples",
                                   alternative="greater").pvalue
    assert abs(rows["chefer2021"]["p_vs_rollout"] - exact) < 0.02
    assert math.isnan(rows["rollout"]["p_vs_rollout"]) and math.isnan(rows["random"]["p_vs_rollout"])
    no_rollout = rows_from_curves({("zero", metric): {m: curves[m] for m in ("chefer2021", "random")}},
                                  model_name="m", fractions=fractions)
    assert all(math.isnan(r["p_vs_rollout"]) for r in no_rollout)


def test_the_flag_marks_methods_that_do_not_beat_the_best_baseline():
    """A synthetic board of 40 images, deletion (lower AUC wins): centre beats random and edges, "strong" beats
    centre on every image, "tied" is centre plus symmetric noise, "between" beats random and edges but not centre.
    p_vs_baselines pairs each with centre (the best baseline), against the same test written out here."""
    from zoo.explain.faithfulness_report import faithfulness_markdown
    from zoo.explain.leaderboard import rows_from_curves
    from zoo.explain.perturbation import auc, paired_p_value

    fractions = (0.0, 0.5, 1.0)
    generator = torch.Generator().manual_seed(0)
    base = torch.rand(40, 3, generator=generator, dtype=torch.float64) * 0.2 + 0.4
    noise = torch.randn(40, 3, generator=generator, dtype=torch.float64) * 0.01
    curves = {"strong": base - 0.2, "tied": base + noise, "between": base + 0.05, "random": base + 0.2,
              "centre": base, "edges": base + 0.1}
    rows = rows_from_curves({("zero", "deletion"): curves}, model_name="m", fractions=fractions)
    by = {r["method"]: r for r in rows}
    for method in ("strong", "tied", "between"):
        expected = paired_p_value(auc(fractions, curves["centre"]), auc(fractions, curves[method]))
        assert by[method]["p_vs_baselines"] == pytest.approx(expected)
    assert by["strong"]["p_vs_baselines"] < 0.01 and by["between"]["p_vs_baselines"] > 0.99
    assert by["between"]["p_vs_random"] < 0.01  # it beats random: only the stronger baselines expose it
    assert all(math.isnan(by[b]["p_vs_baselines"]) for b in ("random", "centre", "edges"))
    table = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[-1]
             for line in faithfulness_markdown(rows, {"m": 40}).splitlines() if line.startswith("| ")}
    assert table["strong"] == "ok"
    assert table["between"] == "**not above baselines**: deletion, zero"
    assert table["random"] == table["centre"] == table["edges"] == "baseline"
