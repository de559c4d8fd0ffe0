"""Attention in fp16 and bf16 against the same module in fp32: every backend under ``torch.autocast`` at
N = 4,096 keys (where an fp16 sum over the keys overflows 65,504), and float masks whose large finite penalty
(-1e9) must not turn into -inf (which would read as "masked") in fp16."""

from __future__ import annotations

import pytest
import torch

from zoo import MultiHeadAttention

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _attention_rows(attn: MultiHeadAttention, x, dtype=None, **kw) -> torch.Tensor:
    """The attention output (B, N, dim) before ``proj`` (where a fully-masked row is exactly 0), in fp32;
    under autocast to ``dtype`` when given."""
    seen = []
    hook = attn.proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype or torch.float32, enabled=dtype is not None):
            attn(x, **kw)
    finally:
        hook.remove()
    if dtype is not None:
        assert seen[0].dtype == dtype  # computed in the autocast dtype, handed back in it
    return seen[0].float()


def _check_like_fp32(backend: str, dtype: torch.dtype, is_causal: bool) -> None:
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 2, backend=backend).eval()
    x = torch.randn(1, 4096, 32)
    ref = _attention_rows(attn, x, is_causal=is_causal)
    out = _attention_rows(attn, x, dtype, is_causal=is_causal)
    assert torch.isfinite(ref).all() and (ref != 0).any(-1).all()  # the fp32 reference has no such row either
    assert torch.isfinite(out).all(), "-inf / NaN where fp32 is finite"
    assert (out != 0).any(-1).all(), "all-zero rows (read as fully masked) where fp32 has none"
    # 1e-2 relative per query row: bf16's 8-bit mantissa gives ~5e-3 here, fp16 ~6e-4; the old fp16 linear
    # attention (its normaliser overflowing) was off by ~50%
    row_error = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert row_error.max() <= 1e-2, f"largest relative row error {row_error.max():.2e}"


def _half_cases():
    """Every backend x precision x mask; the math and chunked backends (seconds each on a CPU) keep two in the
    default suite (fp16 full, bf16 causal), the rest under -m slow."""
    for backend in ("sdpa", "math", "chunked", "linear"):
        for precision in HALF:
            for is_causal, mask in ((False, "full"), (True, "causal")):
                quick = backend in ("sdpa", "linear") or (precision, mask) in (("fp16", "full"), ("bf16", "causal"))
                yield pytest.param(backend, precision, is_causal, id=f"{backend}-{precision}-{mask}",
                                   marks=() if quick else pytest.mark.slow)


@pytest.mark.parametrize("backend, precision, is_causal", _half_cases())
def test_autocast_at_4096_keys_matches_fp32(backend, precision, is_causal):
    _check_like_fp32(backend, HALF[precision], is_causal)


@pytest.mark.slow  # two compiles of flex_attention on the CPU, ~20 s each
@pytest.mark.parametrize("precision", list(HALF))
def test_flex_under_autocast_at_4096_keys_matches_fp32(precision):
    _check_like_fp32("flex", HALF[precision], is_causal=False)


# ---------------------------------------------------------------- float masks of -1e9


def _minus_1e9_mask(n: int) -> torch.Tensor:
    """(1, 1, n, n) float mask: row 0 all -1e9; row 1 -1e9 on keys 0-2 and -inf on the rest; row 2 -1e9 on keys
    3 and later (0 on keys 0-2); other rows -1e9 on a random half of the keys but key 0."""
    mask = torch.where(torch.rand(n, n) < 0.5, -1e9, 0.0)
    mask[:, 0] = 0.0
    mask[0] = -1e9
    mask[1, :3], mask[1, 3:] = -1e9, float("-inf")
    mask[2, :3], mask[2, 3:] = 0.0, -1e9
    return mask[None, None]


@pytest.mark.parametrize("precision", ["autocast_fp16", "fp16_module", "autocast_bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "math", "chunked"])
def test_minus_1e9_float_mask_means_the_same_in_half_precision_as_in_fp32(backend, precision):
    """Rows 0 and 1 have no key at 0 but all their allowed keys at -1e9: not fully masked, in fp32 they average
    those keys' values (-1e9 + score rounds to -1e9 in fp32: their scores are equal, here exactly, as tokens 0
    and 1 are zero vectors, so q = 0 for those rows with qkv_bias off). fp16 must give the same, not 0."""
    torch.manual_seed(0)
    n = 8
    attn = MultiHeadAttention(16, 2, backend=backend, qkv_bias=False, chunk_size=3).eval()
    x = torch.randn(1, n, 16)
    x[:, :2] = 0.0
    mask = _minus_1e9_mask(n)
    ref = _attention_rows(attn, x, mask=mask)
    v = x @ attn.qkv.weight[32:].T  # values by hand: the last third of the fused projection
    torch.testing.assert_close(ref[0, 0], v[0].mean(0))  # the uniform average of every value
    torch.testing.assert_close(ref[0, 1], v[0, :3].mean(0))  # of keys 0-2 only: -inf keys stay masked
    if precision == "fp16_module":  # the module in fp16, the mask left in fp32 as a user would pass it
        out = _attention_rows(attn.half(), x.half(), mask=mask)
        tol = dict(atol=5e-3, rtol=5e-3)
    else:
        dtype = HALF[precision.removeprefix("autocast_")]
        out = _attention_rows(attn, x, dtype, mask=mask)
        tol = dict(atol=5e-3, rtol=5e-3) if dtype == torch.float16 else dict(atol=3e-2, rtol=3e-2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("backend", ["sdpa", "math", "chunked"])
def test_minus_1e9_row_with_very_negative_scores_stays_finite_in_fp16(backend):
    """fp16's -65504 plus a score below -16 overflows to -inf in fp16 arithmetic: a row of -1e9 whose scores are
    all far below zero must still attend (finite, not 0), as it does in fp32. q = k = x (identity projections);
    query 0 points away from keys 1-8, which are near-copies of one vector, so both precisions give about their
    average."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2, backend=backend, qkv_bias=False, chunk_size=3).eval()
    with torch.no_grad():
        attn.qkv.weight[:32] = torch.eye(16).repeat(2, 1)
    u = torch.full((16,), 3.0)
    x = torch.cat([-u[None], u + 0.1 * torch.randn(8, 16)])[None]
    scores = torch.einsum("nhd,mhd->hnm", x[0].view(9, 2, 8), x[0].view(9, 2, 8)) / 8**0.5
    assert (scores[:, 0, 1:] < -16).all()  # the case this test is about
    mask = torch.zeros(1, 1, 9, 9)
    mask[..., 0, 0], mask[..., 0, 1:] = float("-inf"), -1e9
    ref = _attention_rows(attn, x, mask=mask)
    out = _attention_rows(attn.half(), x.half(), mask=mask)
    assert torch.isfinite(out).all() and (out[0, 0] != 0).any()
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("backend", ["sdpa", "math", "chunked"])
def test_an_fp16_float_mask_with_fp32_input_is_read_in_fp32(backend):
    """A float mask of another float dtype than the input means what it says: the scores plus the mask's values,
    as the softmax formula computes them in fp32 (it was 'value cannot be converted to type c10::Half')."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2, backend=backend, chunk_size=3).eval()
    x = torch.randn(2, 5, 16)
    mask = (torch.randn(1, 1, 5, 5) * 3).half()
    mask[..., 0, 2] = float("-inf")
    q, k, v = attn.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
    weights = ((q @ k.transpose(-1, -2)) / 8**0.5 + mask.float()).softmax(-1)
    ref = (weights @ v).transpose(1, 2).reshape(2, 5, 16)
    torch.testing.assert_close(_attention_rows(attn, x, mask=mask), ref.detach(), atol=1e-5, rtol=1e-5)
