"""docs/report.png shows what ``eval.py --report`` writes today: it carries the data it was drawn from
(``zoo.explain.report_figure``), and a test fails when the report's page has changed since (its layout
fingerprint) or when the picture names another most faithful method than the newest leaderboard in results/
(the stale picture named rollout for hybrid_tiny where the leaderboard says AttnLRP). Redraw it with
``python -m zoo.explain.report_figure --data-dir DATA --out docs/report.png``."""

from __future__ import annotations

from pathlib import Path

from benchmarks import results
from zoo.explain import report_figure
from zoo.models.tta import REPORTED_TTA

REPO = Path(__file__).resolve().parents[2]
PICTURE = REPO / "docs" / "report.png"
REDRAW = "redraw it: python -m zoo.explain.report_figure --data-dir DATA --out docs/report.png"


def newest_best(model: str) -> str:
    """``model``'s most faithful method (lowest deletion AUC, baselines excluded) on the newest faithfulness
    leaderboard in results/."""
    boards = sorted((r for r in results.read_all(REPO / "results") if r["kind"] == "faithfulness"),
                    key=lambda r: r["date"])
    board = [b for b in boards if any(row["model"] == model for row in b["numbers"]["rows"])][-1]
    rows = [row for row in board["numbers"]["rows"]
            if row["model"] == model and row["method"] not in ("random", "centre", "edges")]
    return min(rows, key=lambda row: row["deletion"])["method"]


def test_the_report_picture_shows_todays_report():
    drawn = report_figure.read_drawn_from(PICTURE)
    assert drawn is not None, f"docs/report.png does not say what it was drawn from; {REDRAW}"
    assert drawn["layout"] == report_figure.layout_fingerprint(), f"the report's page has changed; {REDRAW}"
    assert sorted(drawn["models"]) == sorted(s.removeprefix("pretrained:") for s in report_figure.SOURCES)
    for model, shown in drawn["models"].items():
        assert shown["tta_level"] == REPORTED_TTA, REDRAW
        assert shown["best_method"] == newest_best(model), (model, shown, REDRAW)
