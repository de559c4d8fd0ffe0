"""Property tests for MultiHeadAttention over random shapes, masks and dtypes (hypothesis): masking never
creates NaN, a query with no allowed key returns proj.bias, a bool mask and its 0 / -inf float twin give the
same output, and the exact backends (sdpa, math, chunked) agree with each other."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo import MultiHeadAttention

EXACT = ("sdpa", "math", "chunked")
MASK_KINDS = ("none", "bool", "bool_per_head", "key_padding", "causal", "float", "bool_and_causal")


@st.composite
def problems(draw, max_n: int = 9, max_head_dim: int = 8):
    """(B, N, M, heads, head_dim, mask kind, cross-attention?, seed)."""
    cross = draw(st.booleans())
    n = draw(st.integers(1, max_n))
    return {
        "b": draw(st.integers(1, 3)), "n": n, "m": draw(st.integers(1, max_n)) if cross else n,
        "heads": draw(st.sampled_from([1, 2, 4])), "head_dim": draw(st.integers(1, max_head_dim)),
        "kind": draw(st.sampled_from(MASK_KINDS)), "cross": cross, "seed": draw(st.integers(0, 2**16)),
    }


def _build(p, dtype):
    """Module, x, context, forward kwargs with a bool mask, and the same with the float (0 / -inf) mask,
    plus allowed (B, H, N, M): which keys each query may attend."""
    gen = torch.Generator().manual_seed(p["seed"])
    b, n, m, h = p["b"], p["n"], p["m"], p["heads"]
    dim = h * p["head_dim"]
    torch.manual_seed(p["seed"])
    attn = MultiHeadAttention(dim, h, chunk_size=3).eval().to(dtype)
    x = torch.randn(b, n, dim, generator=gen).to(dtype)
    context = torch.randn(b, m, dim, generator=gen).to(dtype) if p["cross"] else None
    kind = p["kind"]
    mask_shape = {"bool": (b, 1, n, m), "bool_per_head": (b, h, n, m), "key_padding": (b, 1, 1, m),
                  # a 2-D mask is (N, M); with B == N it is ambiguous (refused), so it is given 4-D there
                  "bool_and_causal": (n, m) if b != n else (1, 1, n, m), "float": (1, h, n, m)}.get(kind)
    is_causal = kind in ("causal", "bool_and_causal")
    allowed = torch.ones(b, h, n, m, dtype=torch.bool)
    if is_causal:
        allowed &= torch.tensor([[j <= i + m - n for j in range(m)] for i in range(n)], dtype=torch.bool)
    if mask_shape is None:
        return attn, x, context, {"is_causal": is_causal}, {"is_causal": is_causal}, allowed
    if kind == "float":
        blocked = torch.rand(mask_shape, generator=gen) < 0.3
        additive = torch.randn(mask_shape, generator=gen).masked_fill(blocked, float("-inf"))
        return attn, x, context, {"mask": additive}, {"mask": additive}, allowed & (additive > float("-inf"))
    mask = torch.rand(mask_shape, generator=gen) < 0.6
    as_float = torch.zeros(mask_shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    return (attn, x, context, {"mask": mask, "is_causal": is_causal},
            {"mask": as_float, "is_causal": is_causal}, allowed & mask)


def _check(p, dtype, atol):
    attn, x, context, bool_kw, float_kw, allowed = _build(p, dtype)
    empty_rows = ~allowed.any(-1).any(1)  # (B, N): queries that see no key in any head
    reference = None
    with torch.no_grad():
        for backend in EXACT:
            attn.backend = backend
            out, out_float = attn(x, context, **bool_kw), attn(x, context, **float_kw)
            assert torch.isfinite(out).all() and torch.isfinite(out_float).all(), backend
            torch.testing.assert_close(out_float, out, atol=atol, rtol=atol, msg=f"{backend}: bool vs float")
            if empty_rows.any():
                bias = attn.proj.bias.expand(int(empty_rows.sum()), -1)
                torch.testing.assert_close(out[empty_rows], bias, atol=0, rtol=0)
            reference = out if reference is None else reference
            torch.testing.assert_close(out, reference, atol=atol, rtol=atol, msg=f"{backend} vs sdpa")


@settings(max_examples=40, deadline=None)
@given(problems())
def test_fp32_masking_is_finite_and_backends_agree(p):
    _check(p, torch.float32, atol=1e-5)


@settings(max_examples=6, deadline=None)
@given(problems(max_n=4, max_head_dim=4))
def test_bf16_masking_is_finite_and_backends_agree(p):
    _check(p, torch.bfloat16, atol=3e-2)
