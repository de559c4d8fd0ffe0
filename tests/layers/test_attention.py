"""zoo.attention.MultiHeadAttention against independent references: torch.nn.MultiheadAttention with the
same weights, hand-written softmax / elu+1 linear attention, explicit masks built with Python loops, and
invariance properties (causality, padding, sliding windows). Backends are compared with each other in
forward and backward for every kind of mask."""

from __future__ import annotations

import contextvars
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zoo
from zoo import KVCache, MultiHeadAttention
from zoo.masks import padding_mask, sliding_window_mask

EXACT = ("sdpa", "math", "chunked")
ALL = (*EXACT, "linear")
DIM, HEADS = 16, 4


@pytest.fixture
def restore_backend():
    old = zoo.get_backend()
    yield
    zoo.set_backend(old)


def _module(backend="math", dim=DIM, heads=HEADS, **kw) -> MultiHeadAttention:
    # chunk_size 3 makes several chunks run for every N used here
    return MultiHeadAttention(dim, heads, backend=backend, chunk_size=3, **kw).eval()


def _torch_mha(attn: MultiHeadAttention) -> nn.MultiheadAttention:
    """torch's module with attn's weights (kdim/vdim = context_dim for a cross-attention module)."""
    cd = attn.context_dim
    mha = nn.MultiheadAttention(attn.dim, attn.num_heads, kdim=cd, vdim=cd, batch_first=True).eval()
    with torch.no_grad():
        if cd is None:
            mha.in_proj_weight.copy_(attn.qkv.weight)
            mha.in_proj_bias.copy_(attn.qkv.bias)
        else:
            k_w, v_w = attn.kv.weight.chunk(2)
            mha.q_proj_weight.copy_(attn.q.weight)
            mha.k_proj_weight.copy_(k_w)
            mha.v_proj_weight.copy_(v_w)
            mha.in_proj_bias.copy_(torch.cat([attn.q.bias, attn.kv.bias]))
        mha.out_proj.weight.copy_(attn.proj.weight)
        mha.out_proj.bias.copy_(attn.proj.bias)
    return mha


def _split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, c = t.shape
    return t.reshape(b, n, heads, c // heads).transpose(1, 2)


def _qkv(attn: MultiHeadAttention, x, context=None):
    """Projections by hand from the parameters (independent of the module's einops code)."""
    if attn.context_dim is None:
        w_q, w_k, w_v = attn.qkv.weight.chunk(3)
        b_q, b_k, b_v = attn.qkv.bias.chunk(3)
    else:
        w_q, b_q = attn.q.weight, attn.q.bias
        (w_k, w_v), (b_k, b_v) = attn.kv.weight.chunk(2), attn.kv.bias.chunk(2)
    ctx = x if context is None else context
    return (_split_heads(x @ w_q.T + b_q, attn.num_heads), _split_heads(ctx @ w_k.T + b_k, attn.num_heads),
            _split_heads(ctx @ w_v.T + b_v, attn.num_heads))


def _merge_project(attn: MultiHeadAttention, o: torch.Tensor) -> torch.Tensor:
    b, h, n, d = o.shape
    return o.transpose(1, 2).reshape(b, n, h * d) @ attn.proj.weight.T + attn.proj.bias


def _reference_softmax(attn, x, context=None, float_mask=None):
    """Softmax attention written out; float_mask (0 / -inf or any additive) broadcast to (B, H, N, M)."""
    q, k, v = _qkv(attn, x, context)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if float_mask is not None:
        scores = scores + float_mask
    return _merge_project(attn, scores.softmax(-1) @ v)


def _reference_linear(attn, x, key_ok=None, causal=False):
    """Katharopoulos et al. elu+1 linear attention via its explicit (N, N) affinity matrix.
    key_ok: (B, N) bool, True = real key."""
    q, k, v = _qkv(attn, x)
    q, k = F.elu(q) + 1, F.elu(k) + 1
    affinity = q @ k.transpose(-1, -2)  # (B, H, N, N)
    if key_ok is not None:
        affinity = affinity * key_ok[:, None, None, :]
    if causal:
        affinity = affinity.tril()
    return _merge_project(attn, (affinity @ v) / affinity.sum(-1, keepdim=True))


def _bool_to_float(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))


# ---------------------------------------------------------------- torch.nn.MultiheadAttention parity


@pytest.mark.parametrize("backend", EXACT)
@pytest.mark.parametrize("masking", ["none", "bool", "float", "key_padding"])
@pytest.mark.parametrize("kind", ["self", "cross_same_width", "cross_context_dim"])
def test_equals_torch_multihead_attention(backend, masking, kind):
    b, n, m = 2, 6, 6 if kind == "self" else 5
    attn = _module(backend, context_dim=12 if kind == "cross_context_dim" else None)
    mha = _torch_mha(attn)
    x = torch.randn(b, n, DIM)
    context = None if kind == "self" else torch.randn(b, m, attn.context_dim or DIM)
    kv_in = x if context is None else context
    ours, theirs = {}, {}
    if masking == "bool":
        allowed = torch.rand(n, m) > 0.4
        allowed[:, 0] = True  # no fully masked row: torch returns NaN there, zoo returns proj.bias
        ours["mask"], theirs["attn_mask"] = allowed, ~allowed
    elif masking == "float":
        additive = torch.randn(n, m)
        ours["mask"], theirs["attn_mask"] = additive, additive
    elif masking == "key_padding":
        lengths = [m, m - 2]
        ours["mask"] = padding_mask(lengths, m)
        theirs["key_padding_mask"] = ~ours["mask"][:, 0, 0]
    with torch.no_grad():
        expected = mha(x, kv_in, kv_in, need_weights=False, **theirs)[0]
        got = attn(x, context, **ours)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", EXACT)
def test_need_weights_equal_torch_per_head_weights(backend):
    attn = _module(backend)
    mha = _torch_mha(attn)
    x = torch.randn(2, 6, DIM)
    allowed = sliding_window_mask(6, 2)
    with torch.no_grad():
        expected_out, expected_w = mha(x, x, x, attn_mask=~allowed, average_attn_weights=False)
        out, w = attn(x, mask=allowed, need_weights=True)
    assert w.shape == (2, HEADS, 6, 6)
    torch.testing.assert_close(w, expected_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- backends agree, forward and backward


def _case(name: str):
    """(module kwargs, x, context, forward kwargs) for one kind of masking; B=2, N=7, M=7 or 5."""
    b, n = 2, 7
    x = torch.randn(b, n, DIM)
    pad = padding_mask([n, 4], n)
    cases = {
        "none": ({}, None, {}),
        "padding": ({}, None, {"mask": pad}),
        "causal": ({}, None, {"is_causal": True}),
        "sliding_window": ({}, None, {"mask": sliding_window_mask(n, 2)}),
        "float": ({}, None, {"mask": torch.randn(b, HEADS, n, n)}),
        "padding_causal_float": ({}, None, {"mask": pad, "is_causal": True}),
        "float_and_causal": ({}, None, {"mask": torch.randn(1, HEADS, n, n), "is_causal": True}),
        "cross": ({"context_dim": 12}, torch.randn(b, 5, 12), {"mask": padding_mask([5, 2], 5)}),
        "cross_causal": ({}, torch.randn(b, 5, DIM), {"is_causal": True}),
        "rel_pos": ({"rel_pos_grid": (2, 3), "num_prefix_tokens": 1}, None, {}),
        "rel_pos_padding": ({"rel_pos_grid": (2, 3), "num_prefix_tokens": 1}, None, {"mask": pad}),
        "fully_masked_rows": ({}, None, {"mask": torch.rand(b, 1, n, n) > 0.5}),
    }
    module_kw, context, fwd = cases[name]
    if name == "padding_causal_float":
        fwd["mask"] = torch.randn(b, HEADS, n, n).masked_fill(~pad, float("-inf"))
    if name == "fully_masked_rows":
        fwd["mask"][:, :, 3] = False
    return module_kw, x, context, fwd


CASES = ["none", "padding", "causal", "sliding_window", "float", "padding_causal_float", "float_and_causal",
         "cross", "cross_causal", "rel_pos", "rel_pos_padding", "fully_masked_rows"]


@pytest.mark.parametrize("name", CASES)
def test_exact_backends_agree_forward_and_gradients(name):
    module_kw, x, context, fwd = _case(name)
    attn = _module(**module_kw)
    results = {}
    for backend in EXACT:
        attn.backend = backend  # public attribute, read at every forward
        attn.zero_grad()
        xg = x.clone().requires_grad_()
        cg = None if context is None else context.clone().requires_grad_()
        out = attn(xg, cg, **fwd)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = {"x": xg.grad, "context": None if cg is None else cg.grad}
        grads.update({k: p.grad.clone() for k, p in attn.named_parameters()})
        results[backend] = (out.detach(), grads)
    ref_out, ref_grads = results["math"]
    assert torch.isfinite(ref_out).all()
    for backend in ("sdpa", "chunked"):
        out, grads = results[backend]
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5, msg=f"{backend} forward")
        for key, g in ref_grads.items():
            if g is not None:
                torch.testing.assert_close(grads[key], g, atol=1e-5, rtol=1e-4, msg=f"{backend} grad {key}")


@pytest.mark.parametrize("name", ["padding", "sliding_window", "padding_causal_float", "cross", "rel_pos"])
def test_math_equals_handwritten_softmax_with_float_mask(name):
    module_kw, x, context, fwd = _case(name)
    attn = _module(**module_kw)
    mask = fwd.get("mask")
    float_mask = None if mask is None else (_bool_to_float(mask) if mask.dtype == torch.bool else mask)
    if attn.rel_pos_bias is not None:
        float_mask = _rel_bias_loop(attn) if float_mask is None else float_mask + _rel_bias_loop(attn)
    if fwd.get("is_causal"):
        float_mask = float_mask + _bool_to_float(torch.ones(x.shape[1], x.shape[1]).tril().bool())
    with torch.no_grad():
        torch.testing.assert_close(attn(x, context, **fwd), _reference_softmax(attn, x, context, float_mask),
                                   atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- invariances


@pytest.mark.parametrize("backend", EXACT)
def test_causal_output_ignores_later_tokens(backend):
    attn = _module(backend)
    x = torch.randn(2, 8, DIM)
    with torch.no_grad():
        out = attn(x, is_causal=True)
        for i in range(7):
            changed = x.clone()
            changed[:, i + 1:] = torch.randn_like(changed[:, i + 1:])
            torch.testing.assert_close(attn(changed, is_causal=True)[:, :i + 1], out[:, :i + 1], atol=1e-5,
                                       rtol=1e-5)
            assert not torch.allclose(attn(changed, is_causal=True)[:, i + 1:], out[:, i + 1:])


@pytest.mark.parametrize("backend", ALL)
def test_padded_keys_do_not_change_real_tokens(backend):
    attn = _module(backend)
    x = torch.randn(2, 8, DIM)
    mask = padding_mask([8, 5], 8)
    changed = x.clone()
    changed[1, 5:] = torch.randn(3, DIM) * 10
    with torch.no_grad():
        out, out_changed = attn(x, mask=mask), attn(changed, mask=mask)
    torch.testing.assert_close(out_changed[1, :5], out[1, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_changed[0], out[0])


@pytest.mark.parametrize("backend", EXACT)
def test_sliding_window_ignores_far_tokens(backend):
    n, w, i = 10, 2, 4
    attn = _module(backend)
    x = torch.randn(1, n, DIM)
    changed = x.clone()
    far = [j for j in range(n) if abs(i - j) > w]
    changed[:, far] = torch.randn(1, len(far), DIM)
    mask = sliding_window_mask(n, w)
    with torch.no_grad():
        torch.testing.assert_close(attn(changed, mask=mask)[:, i], attn(x, mask=mask)[:, i], atol=1e-5,
                                   rtol=1e-5)


# ---------------------------------------------------------------- fully masked rows: proj.bias, never NaN


def _fully_masked(kind: str, b: int, n: int) -> torch.Tensor:
    """A mask whose query row 1 (every batch) and every row of batch 1 may attend nothing."""
    allowed = torch.rand(b, 1, n, n) > 0.3
    allowed[:, :, :, 0] = True
    allowed[:, :, 1] = False
    allowed[1] = False
    return allowed if kind == "bool" else _bool_to_float(allowed)


def _key_padding_fully_masked(kind: str, b: int, n: int) -> torch.Tensor:
    """Key padding with an empty sequence (batch 1): the only fully-masked rows the linear backend takes."""
    allowed = padding_mask([n - 1, 0], n)
    return allowed if kind == "bool" else _bool_to_float(allowed)


def _check_fully_masked(attn, x, mask, rows):
    xg = x.clone().requires_grad_()
    out = attn(xg, mask=mask)
    assert torch.isfinite(out).all()
    expected = attn.proj.bias.to(out.dtype).expand(len(rows), out.shape[-1])
    torch.testing.assert_close(out[rows[:, 0], rows[:, 1]], expected, atol=0, rtol=0)
    out.float().square().sum().backward()
    assert torch.isfinite(xg.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters())


@pytest.mark.parametrize("backend, kind", [*((b, k) for b in EXACT for k in ("bool", "float")),
                                            ("linear", "bool")])  # linear takes only bool key masks
@pytest.mark.parametrize("precision", ["fp32", "autocast_bf16", "autocast_fp16", "fp16"])
def test_fully_masked_rows_give_proj_bias_and_no_nan(backend, kind, precision):
    b, n = 2, 5
    make_mask = _key_padding_fully_masked if backend == "linear" else _fully_masked
    mask = make_mask(kind, b, n)
    allowed = mask if mask.dtype == torch.bool else mask == 0
    rows = (~allowed.expand(b, 1, n, n)[:, 0].any(-1)).nonzero()  # (batch, query) pairs with no key
    attn = _module(backend).train()  # train mode with zero dropout: exercises the checkpointed chunks
    x = torch.randn(b, n, DIM)
    if precision == "fp16":
        attn, x, mask = attn.half(), x.half(), mask.half() if kind == "float" else mask
        _check_fully_masked(attn, x, mask, rows)
    elif precision.startswith("autocast"):
        with torch.autocast("cpu", dtype=torch.bfloat16 if precision == "autocast_bf16" else torch.float16):
            _check_fully_masked(attn, x, mask, rows)
    else:
        _check_fully_masked(attn, x, mask, rows)


# ---------------------------------------------------------------- causal alignment and the KV cache


@pytest.mark.parametrize("backend", EXACT)
def test_is_causal_with_fewer_queries_is_bottom_right_aligned(backend):
    n, m = 3, 6
    attn = _module(backend)
    x, context = torch.randn(2, n, DIM), torch.randn(2, m, DIM)
    by_hand = torch.tensor([[j <= i + (m - n) for j in range(m)] for i in range(n)])
    with torch.no_grad():
        torch.testing.assert_close(attn(x, context, is_causal=True), attn(x, context, mask=by_hand),
                                   atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(attn(x, context, is_causal=True),
                                   _reference_softmax(attn, x, context, _bool_to_float(by_hand)), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("backend", EXACT)
def test_kv_cache_step_by_step_equals_one_causal_pass(backend):
    attn = _module(backend)
    x = torch.randn(2, 7, DIM)
    cache = KVCache()
    with torch.no_grad():
        full = attn(x, is_causal=True)
        steps = torch.cat([attn(x[:, t:t + 1], is_causal=True, kv_cache=cache) for t in range(7)], dim=1)
    assert len(cache) == 7
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    causal = _bool_to_float(torch.ones(7, 7).tril().bool())
    torch.testing.assert_close(full, _reference_softmax(attn, x, float_mask=causal), atol=1e-5, rtol=1e-5)


def test_kv_cache_rejects_other_batch():
    attn = _module()
    cache = KVCache()
    attn(torch.randn(2, 1, DIM), is_causal=True, kv_cache=cache)
    with pytest.raises(ValueError, match=r"\(2, 4, 1, 4\).*\(3, 4, 1, 4\)"):
        attn(torch.randn(3, 1, DIM), is_causal=True, kv_cache=cache)


# ---------------------------------------------------------------- relative position bias


def _rel_bias_loop(attn: MultiHeadAttention) -> torch.Tensor:
    """(H, T, T) bias by an explicit loop over patch pairs: table row of offset (dy, dx) is
    (dy + gh - 1) * (2 gw - 1) + dx + gw - 1; prefix tokens get 0."""
    rpb = attn.rel_pos_bias
    (gh, gw), p = rpb.grid, rpb.num_prefix_tokens
    table = rpb.relative_position_bias_table.detach()
    bias = torch.zeros(attn.num_heads, p + gh * gw, p + gh * gw)
    for i in range(gh * gw):
        for j in range(gh * gw):
            dy, dx = i // gw - j // gw, i % gw - j % gw
            bias[:, p + i, p + j] = table[(dy + gh - 1) * (2 * gw - 1) + dx + gw - 1]
    return bias


def test_rel_pos_module_output_equals_math_with_bias_as_float_mask():
    attn = _module("sdpa", rel_pos_grid=(2, 3), num_prefix_tokens=1)
    with torch.no_grad():
        attn.rel_pos_bias.relative_position_bias_table.normal_()
    bias = _rel_bias_loop(attn)
    assert bias[:, 0].abs().sum() == 0 and bias[:, :, 0].abs().sum() == 0 and bias[:, 1:, 1:].abs().sum() > 0
    x = torch.randn(2, 7, DIM)
    plain = _module("math")
    plain.load_state_dict(attn.state_dict(), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), plain(x, mask=bias), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(attn(x), _reference_softmax(attn, x, float_mask=bias), atol=1e-5,
                                   rtol=1e-5)


def test_rel_pos_bias_gets_gradients():
    attn = _module("sdpa", rel_pos_grid=(2, 3))
    attn(torch.randn(1, 6, DIM)).sum().backward()
    assert attn.rel_pos_bias.relative_position_bias_table.grad.abs().sum() > 0


# ---------------------------------------------------------------- linear backend (an approximation)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_linear_backend_equals_handwritten_elu_linear_attention(causal, padded):
    attn = _module("linear")
    x = torch.randn(2, 9, DIM)
    lengths = [9, 6]
    mask = padding_mask(lengths, 9) if padded else None
    key_ok = mask[:, 0, 0] if padded else None
    with torch.no_grad():
        torch.testing.assert_close(attn(x, mask=mask, is_causal=causal),
                                   _reference_linear(attn, x, key_ok, causal), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(attn(x, mask=mask, is_causal=causal),
                                  _reference_softmax(attn, x, float_mask=None), atol=1e-3)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_linear_backend_is_linear_in_n(causal):
    n = 16384
    attn = _module("linear", dim=32, heads=2)
    x = torch.randn(1, n, 32)
    start = time.perf_counter()
    with torch.no_grad(), _LargestTensor() as spy:
        out = attn(x, is_causal=causal)
    elapsed = time.perf_counter() - start
    assert out.shape == (1, n, 32) and torch.isfinite(out).all()
    assert spy.largest <= n * 2 * 16 * 16, f"largest intermediate has {spy.largest} elements (N*N = {n * n})"
    assert elapsed < 10, f"linear attention at N={n} took {elapsed:.1f} s"


@pytest.mark.parametrize("fwd", [
    {"mask": torch.randn(1, 1, 6, 6)},
    {"mask": sliding_window_mask(6, 1)},
    {"mask": torch.ones(1, 1, 1, 6)},
], ids=["float", "per_query_bool", "float_key_mask"])
def test_linear_backend_rejects_unsupported_masks(fwd):
    with pytest.raises(ValueError, match="linear backend"):
        _module("linear")(torch.randn(1, 6, DIM), **fwd)


def test_linear_backend_rejects_rel_pos_and_kv_cache():
    with pytest.raises(ValueError, match="linear backend"):
        _module("linear", rel_pos_grid=(2, 3))(torch.randn(1, 6, DIM))
    attn = _module("linear")
    cache = KVCache()
    attn(torch.randn(1, 1, DIM), is_causal=True, kv_cache=cache)
    with pytest.raises(ValueError, match="linear backend"):
        attn(torch.randn(1, 1, DIM), is_causal=True, kv_cache=cache)


# ---------------------------------------------------------------- bad input


def test_dim_not_divisible_by_heads():
    with pytest.raises(ValueError, match=r"dim \(10\).*num_heads \(3\)"):
        MultiHeadAttention(10, 3)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"dim": 0}, r"dim must be an int >= 1, got 0"),
    ({"dim": 16.0}, r"dim must be an int >= 1, got 16\.0"),
    ({"num_heads": 2.0}, r"num_heads must be an int >= 1, got 2\.0"),
    ({"num_heads": 0}, r"num_heads must be an int >= 1, got 0"),
    ({"context_dim": 0}, r"context_dim must be an int >= 1, got 0"),
    ({"chunk_size": 0}, r"chunk_size must be an int >= 1, got 0"),
    ({"chunk_size": True}, r"chunk_size must be an int >= 1, got True"),
    ({"attn_drop": 1.5}, r"attn_drop must be a probability in \[0, 1\), got 1\.5"),
    ({"attn_drop": -0.1}, r"attn_drop must be a probability in \[0, 1\), got -0\.1"),
    ({"proj_drop": 1.0}, r"proj_drop must be a probability in \[0, 1\), got 1\.0"),
    ({"proj_drop": "0.1"}, r"proj_drop must be a probability in \[0, 1\), got '0\.1'"),
    ({"num_prefix_tokens": -1}, r"num_prefix_tokens must be an int >= 0, got -1"),
    ({"rel_pos_grid": 8}, r"rel_pos_grid must be two positive ints \(gh, gw\), got 8"),
    ({"rel_pos_grid": (2, 3, 4)}, r"rel_pos_grid must be two positive ints \(gh, gw\), got \(2, 3, 4\)"),
    ({"rel_pos_grid": (2.0, 3)}, r"rel_pos_grid must be two positive ints \(gh, gw\), got \(2\.0, 3\)"),
    ({"backend": "flash"}, r"unknown attention backend 'flash'; expected one of \('auto', 'sdpa'"),
    ({"backend": None}, r"unknown attention backend None; expected one of \('auto', 'sdpa'"),
], ids=["dim_0", "dim_float", "heads_float", "heads_0", "context_dim_0", "chunk_0", "chunk_bool", "attn_drop_1.5",
        "attn_drop_negative", "proj_drop_1", "proj_drop_str", "prefix_negative", "grid_int", "grid_triple",
        "grid_float", "backend_unknown", "backend_none"])
def test_bad_constructor_argument_raises_value_error_naming_it(kwargs, pattern):
    args = {"dim": DIM, "num_heads": HEADS, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(args.pop("dim"), args.pop("num_heads"), **args)


@pytest.mark.parametrize("call, pattern", [
    (lambda a: a(torch.randn(4, DIM)), r"\(B, N, dim=16\).*\(4, 16\)"),
    (lambda a: a(torch.randn(2, 5, 8)), r"\(B, N, dim=16\).*\(2, 5, 8\)"),
    (lambda a: a(torch.randint(0, 3, (2, 5, DIM))), r"floating-point.*torch.int64"),
    (lambda a: a(torch.randn(2, 5, DIM), torch.randn(2, 4, 8)), r"context_dim=16.*\(2, 4, 8\)"),
    (lambda a: a(torch.randn(2, 5, DIM), torch.randn(3, 4, DIM)), r"context batch 3 != x batch 2"),
    (lambda a: a(torch.randn(2, 5, DIM), mask=torch.ones(5, 5, dtype=torch.int64)),
     r"bool .* or float.*torch.int64"),
    (lambda a: a(torch.randn(2, 5, DIM), mask=torch.ones(2, 3, 5, 5, dtype=torch.bool)),
     r"\(2, 4, 5, 5\).*\(2, 3, 5, 5\)"),
    (lambda a: a(torch.randn(2, 5, DIM), mask=torch.ones(5, dtype=torch.bool)), r"\(2, 4, 5, 5\).*\(5,\)"),
    (lambda a: a(torch.randn(2, 5, DIM), mask=torch.ones(5, 5, dtype=torch.bool, device="meta")),
     r"meta.*cpu"),
    (lambda a: a(torch.randn(2, 5, DIM), mask=[[True]]), r"got list"),
    (lambda a: a(torch.randn(2, 5, DIM), is_causal="yes"), r"is_causal must be a bool, got 'yes'"),
    (lambda a: a(torch.randn(2, 5, DIM), need_weights=1), r"need_weights must be a bool, got 1"),
], ids=["rank", "width", "int_input", "context_width", "context_batch", "int_mask", "mask_heads",
        "mask_rank", "mask_device", "mask_type", "is_causal_str", "need_weights_int"])
def test_bad_input_raises_value_error_naming_expected_and_given(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call(_module())


def test_cross_attention_module_needs_context():
    with pytest.raises(ValueError, match=r"context_dim=12.*pass a context"):
        _module(context_dim=12)(torch.randn(1, 3, DIM))
    with pytest.raises(ValueError, match=r"context_dim=12.*\(1, 3, 16\)"):
        _module(context_dim=12)(torch.randn(1, 3, DIM), torch.randn(1, 3, DIM))


def test_unknown_backend_raises_everywhere(restore_backend):
    with pytest.raises(ValueError, match=r"'flash'.*'sdpa'"):
        MultiHeadAttention(DIM, HEADS, backend="flash")
    attn = _module()
    attn.backend = "flash"
    with pytest.raises(ValueError, match=r"'flash'.*'sdpa'"):
        attn(torch.randn(1, 3, DIM))
    with pytest.raises(ValueError, match=r"'flash'.*'sdpa'"):
        zoo.set_backend("flash")
    with pytest.raises(ValueError, match=r"'auto'"):
        zoo.set_backend("auto")


def test_rel_pos_with_wrong_token_count():
    attn = _module(rel_pos_grid=(2, 3), num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r"N == M == 7.*N=6, M=6"):
        attn(torch.randn(1, 6, DIM))
    with pytest.raises(ValueError, match=r"rel_pos_grid.*\(0, 3\)"):
        MultiHeadAttention(DIM, HEADS, rel_pos_grid=(0, 3))


@pytest.mark.parametrize("backend", ALL)
def test_nan_input_stays_in_its_batch_element(backend):
    attn = _module(backend)
    x = torch.randn(2, 5, DIM)
    x[0, 2, 3] = float("nan")
    x[0, 1, 0] = float("inf")
    with torch.no_grad():
        out = attn(x, mask=padding_mask([5, 4], 5))
    assert torch.isfinite(out[1]).all()


@pytest.mark.parametrize("backend", ALL)
def test_non_contiguous_and_channels_last_inputs(backend):
    attn = _module(backend)
    wide = torch.randn(2, 6, 2 * DIM)
    x = wide[..., ::2]  # strided view
    image = torch.randn(2, DIM, 2, 3).to(memory_format=torch.channels_last)
    tokens = image.flatten(2).transpose(1, 2)  # (B, 6, DIM) from channels_last storage
    context = torch.randn(6, 2, DIM).transpose(0, 1)
    with torch.no_grad():
        assert not x.is_contiguous() and not context.is_contiguous()
        torch.testing.assert_close(attn(x), attn(x.contiguous()))
        torch.testing.assert_close(attn(tokens), attn(tokens.contiguous()))
        torch.testing.assert_close(attn(x, context), attn(x.contiguous(), context.contiguous()))


# ---------------------------------------------------------------- what backend="auto" means: zoo.attention_backend


def test_attention_backend_changes_auto_for_existing_modules_inside_the_block_only():
    attn = _module("auto")
    x = torch.randn(2, 6, DIM)
    assert attn.resolved_backend() == "sdpa"
    with torch.no_grad():
        with zoo.attention_backend("linear") as name:
            assert name == "linear" and attn.resolved_backend() == "linear" and attn.backend == "auto"
            torch.testing.assert_close(attn(x), _reference_linear(attn, x), atol=1e-5, rtol=1e-5)
            with pytest.raises(ValueError, match="linear backend"):
                attn(x, mask=torch.randn(6, 6))
        with zoo.attention_backend("chunked"):
            assert attn.resolved_backend() == "chunked"
            torch.testing.assert_close(attn(x), _reference_softmax(attn, x), atol=1e-5, rtol=1e-5)
    assert zoo.get_backend() == "sdpa"
    assert attn.resolved_backend() == "sdpa" and attn.resolved_backend(need_weights=True) == "math"


def test_attention_backend_is_restored_after_an_exception():
    attn = _module("auto")
    with pytest.raises(RuntimeError, match="raised inside the block"):
        with zoo.attention_backend("math"):
            assert attn.resolved_backend() == "math"
            raise RuntimeError("raised inside the block")
    assert zoo.get_backend() == attn.resolved_backend() == "sdpa"
    with pytest.raises(ValueError, match="linear backend"), zoo.attention_backend("linear"):
        attn(torch.randn(1, 6, DIM), mask=torch.randn(6, 6))  # an error from the forward itself
    assert attn.resolved_backend() == "sdpa"


def test_attention_backend_blocks_nest():
    attn = _module("auto")
    with zoo.attention_backend("math"):
        with zoo.attention_backend("linear"):
            with zoo.attention_backend("chunked"):
                assert attn.resolved_backend() == "chunked"
            assert attn.resolved_backend() == "linear"
        assert attn.resolved_backend() == "math"
    assert attn.resolved_backend() == "sdpa"


@pytest.mark.parametrize("backend", ALL)
def test_attention_backend_leaves_modules_with_an_explicit_backend_alone(backend):
    attn = _module(backend)
    x = torch.randn(2, 6, DIM)
    with torch.no_grad():
        expected = attn(x)
        for auto in ("linear", "math"):
            with zoo.attention_backend(auto):
                assert attn.backend == attn.resolved_backend() == backend
                torch.testing.assert_close(attn(x), expected)


def test_attention_backend_refuses_auto_and_unknown_names_and_changes_nothing():
    for name, pattern in (("auto", r"'auto'.*expected one of \('sdpa'"), ("flash", r"'flash'.*'sdpa'")):
        with pytest.raises(ValueError, match=pattern), zoo.attention_backend(name):
            pass
    assert zoo.get_backend() == "sdpa"


def test_attention_backend_is_per_thread():
    """Two threads inside blocks of their own at the same time each see only their own setting, and a
    thread started inside a block starts from the default."""
    attn = _module("auto")
    x = torch.randn(2, 6, DIM)
    both_inside = threading.Barrier(2, timeout=30)
    both_read = threading.Barrier(2, timeout=30)
    seen, errors = {}, []

    def worker():
        try:
            seen["worker_at_start"] = attn.resolved_backend()
            with zoo.attention_backend("linear"):
                both_inside.wait()
                seen["worker"] = attn.resolved_backend()
                with torch.no_grad():
                    torch.testing.assert_close(attn(x), _reference_linear(attn, x), atol=1e-5, rtol=1e-5)
                both_read.wait()
        except Exception as err:  # re-raised in the main thread below
            errors.append(err)
            both_inside.abort()
            both_read.abort()

    thread = threading.Thread(target=worker)
    with zoo.attention_backend("chunked"):
        thread.start()
        both_inside.wait()
        seen["main"] = attn.resolved_backend()
        with torch.no_grad():
            torch.testing.assert_close(attn(x), _reference_softmax(attn, x), atol=1e-5, rtol=1e-5)
        both_read.wait()
    thread.join()
    assert not errors, errors
    assert seen == {"worker_at_start": "sdpa", "worker": "linear", "main": "chunked"}
    assert attn.resolved_backend() == "sdpa"


def test_set_backend_and_get_backend_are_thin_wrappers_over_the_same_setting():
    """The documented wrappers, run in a copied context so nothing they set can reach other tests."""
    attn = _module("auto")
    x = torch.randn(2, 6, DIM)

    def script():
        assert zoo.get_backend() == "sdpa"
        assert zoo.set_backend("linear") == "sdpa"
        assert zoo.get_backend() == attn.resolved_backend() == "linear"
        with torch.no_grad():
            torch.testing.assert_close(attn(x), _reference_linear(attn, x), atol=1e-5, rtol=1e-5)
        with zoo.attention_backend("chunked"):
            assert zoo.get_backend() == "chunked"
            assert zoo.set_backend("math") == "chunked"
            assert attn.resolved_backend() == "math"
        assert zoo.get_backend() == "linear"  # the block's exit undid the set_backend inside it
        other = threading.Thread(target=lambda: seen.append(zoo.get_backend()))
        other.start()
        other.join()
        assert zoo.set_backend("sdpa") == "linear"

    seen = []
    contextvars.copy_context().run(script)
    assert seen == ["sdpa"]  # another thread never sees set_backend
    assert zoo.get_backend() == attn.resolved_backend() == "sdpa"


def test_torch_compile_follows_attention_backend_without_graph_breaks():
    """A compiled tiny model of backend="auto" modules: dynamo reads the ContextVar when it traces and guards
    on it (fullgraph: no graph break), so a block with another setting recompiles instead of reusing. Dynamo's
    tracing and guards are the subject: its eager backend skips inductor's code generation."""
    model = nn.Sequential(_module("auto"), nn.LayerNorm(DIM), _module("auto")).eval()
    x = torch.randn(2, 6, DIM)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        eager_sdpa = model(x)
        torch.testing.assert_close(compiled(x), eager_sdpa, atol=1e-5, rtol=1e-5)
        with zoo.attention_backend("linear"):
            eager_linear = model(x)
            torch.testing.assert_close(compiled(x), eager_linear, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(eager_linear, eager_sdpa, atol=1e-3)
        torch.testing.assert_close(compiled(x), eager_sdpa, atol=1e-5, rtol=1e-5)


def test_torch_export_records_the_backend_in_effect_when_it_traces():
    attn = _module("auto")
    x = torch.randn(2, 6, DIM)
    with zoo.attention_backend("linear"):
        exported = torch.export.export(attn, (x,)).module()
    with torch.no_grad():
        torch.testing.assert_close(exported(x), _reference_linear(attn, x), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- torch.compile


def test_torch_compile_matches_eager():
    attn = _module("sdpa")
    x = torch.randn(2, 6, DIM)
    mask = padding_mask([6, 3], 6)
    compiled = torch.compile(attn)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, mask=mask), attn(x, mask=mask), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ALL)
def test_torch_compile_every_backend_forward_backward(backend):
    attn = _module(backend, rel_pos_grid=None)
    x = torch.randn(2, 6, DIM, requires_grad=True)
    compiled = torch.compile(attn)
    out = compiled(x, is_causal=True)
    out.sum().backward()
    torch.testing.assert_close(out, attn(x, is_causal=True), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(x.grad).all()
