"""The README's figure: its rows show each shipped model's most faithful method as results/ measured it (the
deletion leaderboard, random excluded), bad input is refused, and (slow) the command draws a PNG from real data."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import results
from zoo.explain import readme_figure

REPO = Path(__file__).resolve().parents[2]


def test_rows_show_each_models_most_faithful_method():
    boards = sorted((r for r in results.read_all(REPO / "results") if r["kind"] == "faithfulness"),
                    key=lambda r: r["date"])
    for model in {m for m, _ in readme_figure.ROWS}:
        board = [b for b in boards if any(row["model"] == model for row in b["numbers"]["rows"])][-1]  # the newest
        rows = [row for row in board["numbers"]["rows"]
                if row["model"] == model and row["method"] not in ("random", "centre", "edges")]
        best = min(rows, key=lambda row: row["deletion"])["method"]
        assert (model, best) in readme_figure.ROWS, (model, best)
        assert (model, "rollout") in readme_figure.ROWS   # rollout shown for every model, for comparison


def test_no_images_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="num_images must be >= 1"):
        readme_figure.readme_figure(None, tmp_path / "f.png", num_images=0)
    assert readme_figure.main(["--num-images", "0", "--out", str(tmp_path / "f.png")]) == 2


@pytest.mark.slow
def test_draws_a_png_from_real_data(cifar_dir, tmp_path):
    out = readme_figure.readme_figure(str(cifar_dir), tmp_path / "figure.png", num_images=2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size < 400_000
