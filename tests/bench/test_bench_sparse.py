"""The sliding-window benchmark (zoo.bench.sparse) on small sizes: which candidates it measures where, that
they compute the same attention, that rows carry time and memory, that the claims read the right rows, and
that the command writes its files. No speed is asserted (speeds are results, in BENCHMARKS.md)."""

from __future__ import annotations

import json

import pytest
import torch

from zoo.bench import sparse


def test_candidates_follow_the_size_and_mode_limits():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert sparse.candidates(4096, "fwd", cpu) == ["dense", "math", "masked_sdpa", "banded", "flex", "auto",
                                                   "projections"]
    assert sparse.candidates(4096, "fwd", cpu, first_window=False) == ["masked_sdpa", "banded", "flex", "auto"]
    assert sparse.candidates(16384, "fwd", cpu) == ["banded", "flex", "auto", "projections"]
    assert sparse.candidates(4096, "fwd+bwd", cpu) == ["dense", "math", "masked_sdpa", "banded", "auto",
                                                       "projections"]  # no flex backward on a CPU
    assert "flex" in sparse.candidates(16384, "fwd+bwd", cuda)


def test_windowed_candidates_compute_the_same_attention():
    torch.manual_seed(0)
    outs = {}
    for name in ("masked_sdpa", "banded", "auto"):
        torch.manual_seed(0)  # the same weights and input for every candidate
        attn = sparse.MultiHeadAttention(sparse.DIM, sparse.HEADS, backend=sparse.BACKENDS[name])
        x = torch.randn(1, 300, sparse.DIM)
        mask = sparse.spec(window=16)
        with torch.no_grad():
            outs[name] = attn(x, mask=mask.dense(300)[0, 0] if name == "masked_sdpa" else mask)
    torch.testing.assert_close(outs["banded"], outs["masked_sdpa"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["auto"], outs["masked_sdpa"], atol=1e-5, rtol=1e-5)


def test_rows_and_memory_and_claims_on_small_sizes():
    rows = sparse.time_rows(ns=(128, 512), windows=(8,), modes=("fwd+bwd",), repeats=1)  # no flex: no compile
    rows = sparse.memory_rows(rows)
    assert [(r["n"], r["window"], r["mode"]) for r in rows] == [(128, 8, "fwd+bwd"), (512, 8, "fwd+bwd")]
    for r in rows:
        for name in ("dense", "math", "masked_sdpa", "banded", "auto", "projections"):
            assert r[f"{name}_ms"] > 0 and r[f"{name}_mb"] is not None
        scores = sparse.HEADS * r["n"] ** 2 * 4 / 2**20  # one fp32 (H, N, N) score matrix, MiB
        assert scores <= r["math_mb"] <= 4 * scores + r["projections_mb"]  # math keeps its N x N softmax
        assert r["projections_mb"] <= r["banded_mb"]
    assert rows[1]["banded_mb"] < rows[1]["math_mb"] / 2  # at N = 512 the band is a fraction of N x N
    fake_fwd = [{**r, "mode": "fwd", "flex_ms": 1.0} for r in rows]
    claims = sparse.sparse_claims(rows + fake_fwd, n=512, window=8)
    by_claim = {c["claim"]: c["measured"] for c in claims}
    assert by_claim["window ±8 inference, flex >= 3x faster than masked SDPA"] == pytest.approx(
        rows[1]["masked_sdpa_ms"] / 1.0)
    assert by_claim["window ±8 training, auto >= 3x faster than masked SDPA"] == pytest.approx(
        rows[1]["masked_sdpa_ms"] / rows[1]["auto_ms"])
    assert by_claim["window ±8 training, auto >= 4x less peak memory than dense (math)"] == pytest.approx(
        rows[1]["math_mb"] / rows[1]["auto_mb"])
    assert not any("(projections)" in claim for claim in by_claim)  # the floor is no dense candidate
    assert by_claim["the most any candidate can save against dense (sdpa): dense's peak over the layer without "
                    "attention"] == pytest.approx(rows[1]["dense_mb"] / rows[1]["projections_mb"])
    assert by_claim["banded time linear in N: <= 5x for 4x the tokens (fwd+bwd)"] == pytest.approx(
        rows[1]["banded_ms"] / rows[0]["banded_ms"])


@pytest.mark.slow
def test_the_command_writes_its_files(tmp_path):
    """The quick run compiles flex for every (N, window): slow."""
    sparse.main(["--quick", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "sparse.json").read_text())
    assert results["rows"] and results["claims"] and (tmp_path / "sparse.md").exists()


def test_local_vit_row_compares_with_the_dense_vit():
    (row,) = sparse.bench_local_vit((32,), batch=2, repeats=1)
    assert row["img_size"] == 32 and row["tokens"] == 64
    assert all(row[k] > 0 for k in ("dense_vit_img_s", "local_auto_img_s", "local_banded_img_s",
                                    "local_auto_vs_dense", "local_banded_vs_dense"))
