"""Attention that skips work: a ``zoo.masks.spec`` on every backend against the math backend given the same
mask as a dense bool tensor (forward and gradients, atol 1e-5 fp32), the banded chunked path (it reads only
the band: counted in FLOPs), the fixed rule "auto" follows, and the "flex" backend (forward on the CPU; its
refusals need no compile)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.flop_counter import FlopCounterMode

import zoo
from zoo import MultiHeadAttention
from zoo.layers.backends import BANDED_MIN_N, auto_sparse
from zoo.masks import spec

DIM, HEADS = 16, 4

SPECS = {
    "window": dict(window=2),
    "window0": dict(window=0),
    "causal": dict(causal=True),
    "causal_window": dict(causal=True, window=3),
    "window_lengths": dict(window=2, lengths=[13, 6]),
    "causal_window_lengths_empty": dict(causal=True, window=1, lengths=[9, 0]),  # batch 1: every row masked
    "lengths": dict(lengths=[13, 0]),
    "grid_window": dict(window=1, grid=(3, 4)),  # the rel_pos case adds a prefix token: its own grid there
}


def _module(backend="math", **kw) -> MultiHeadAttention:
    # chunk_size 3: several chunks (and several bands) for N = 13
    return MultiHeadAttention(DIM, HEADS, backend=backend, chunk_size=3, **kw)


def _run(attn, x, mask, context=None):
    """(out, grads of x and of every parameter) of one forward + a weighted backward."""
    attn.zero_grad()
    xg = x.clone().requires_grad_()
    out = attn(xg, context, mask=mask)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {"x": xg.grad, **{k: p.grad.clone() for k, p in attn.named_parameters()}}


def _assert_same(got, ref, what):
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5, msg=f"{what} forward")
    for key, g in ref[1].items():
        torch.testing.assert_close(got[1][key], g, atol=1e-5, rtol=1e-4, msg=f"{what} grad {key}")


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("rel_pos", [False, True])
@pytest.mark.parametrize("backend", ["sdpa", "math", "chunked"])
def test_spec_equals_math_with_the_dense_mask_forward_and_gradients(backend, rel_pos, name):
    kw = SPECS[name]
    n = 12 if "grid" in kw else 13  # with rel_pos: a 3 x 4 grid, and a prefix token when N = 13
    module_kw = dict(rel_pos_grid=(3, 4), num_prefix_tokens=n - 12) if rel_pos else {}
    attn = _module(**module_kw).train()  # train mode, dropout 0: the banded path runs plain autograd
    x = torch.randn(2, n, DIM)
    s = spec(**kw)
    reference = _run(attn, x, s.dense(n))  # math with the bool tensor the spec stands for
    attn.backend = backend
    result = _run(attn, x, s)
    _assert_same(result, reference, backend)
    empty_rows = ~s.row_ok(n).expand(2, 1, n, 1)[:, 0, :, 0]
    if empty_rows.any():  # rows with no key: proj.bias exactly, never NaN
        torch.testing.assert_close(result[0][empty_rows], attn.proj.bias.detach().expand(int(empty_rows.sum()), DIM),
                                   atol=0, rtol=0)
    assert all(torch.isfinite(g).all() for g in result[1].values())


@pytest.mark.parametrize("kw", [dict(causal=True, window=2), dict(window=1, lengths=[8, 3])], ids=str)
def test_banded_with_a_kv_cache_shape_is_bottom_right_aligned(kw):
    """N = 4 queries against M = 9 keys (the shape a KV cache gives), banded vs math with the dense mask."""
    attn = _module()
    x, context = torch.randn(2, 4, DIM), torch.randn(2, 9, DIM)
    s = spec(**kw)
    reference = _run(attn, x, s.dense(4, 9), context)
    attn.backend = "chunked"
    _assert_same(_run(attn, x, s, context), reference, "banded")


def test_banded_with_more_queries_than_keys():
    """N = 40 queries against M = 6 keys, window 3: the early chunks' bands hold no key at all (their rows give
    proj.bias); banded vs math with the dense mask, forward and gradients."""
    attn = _module()
    x, context = torch.randn(2, 40, DIM), torch.randn(2, 6, DIM)
    s = spec(window=3)
    reference = _run(attn, x, s.dense(40, 6), context)
    attn.backend = "chunked"
    _assert_same(_run(attn, x, s, context), reference, "banded")


def _graph_nodes(fn) -> list[str]:
    """The names of every autograd node behind ``fn`` (a grad_fn)."""
    seen, todo, names = set(), [fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def test_banded_backward_slices_no_band_out_of_the_keys():
    """Each band is a cat of key blocks split once, never a slice of k / v: a slice's backward writes a
    zero-filled gradient of all N keys per chunk, which made the banded backward quadratic in N."""
    attn = MultiHeadAttention(32, 2, backend="chunked", chunk_size=64)
    x = torch.randn(1, 512, 32, requires_grad=True)
    nodes = _graph_nodes(attn(x, mask=spec(window=8)).grad_fn)
    assert nodes.count("CatBackward0") >= 512 // 64 and "SliceBackward0" not in nodes


def test_spec_with_is_causal_and_with_the_linear_backend():
    attn = _module()
    x = torch.randn(2, 7, DIM)
    with torch.no_grad():
        ref = attn(x, mask=spec(causal=True, window=2).dense(7))
        attn.backend = "chunked"
        torch.testing.assert_close(attn(x, mask=spec(window=2), is_causal=True), ref, atol=1e-5, rtol=1e-5)
        attn.backend = "linear"  # causal + lengths become the linear backend's causal flag and key mask
        lengths = spec(causal=True, lengths=[7, 4])
        torch.testing.assert_close(attn(x, mask=lengths), attn(x, mask=lengths.dense(1, 7)[:, :, :1],
                                                                is_causal=True), atol=1e-6, rtol=1e-6)
        with pytest.raises(ValueError, match="linear backend cannot take a window"):
            attn(x, mask=spec(window=2))


def test_spec_lengths_must_match_the_batch_and_the_keys():
    attn = _module()
    with pytest.raises(ValueError, match=r"2 lengths, expected one per batch element \(B=3\)"):
        attn(torch.randn(3, 5, DIM), mask=spec(lengths=[5, 5]))
    with pytest.raises(ValueError, match=r"\[0, M=5\], got \[6\]"):
        attn(torch.randn(1, 5, DIM), mask=spec(lengths=[6]))


def test_banded_path_reads_only_the_band():
    """FLOPs of the chunked backend with a windowed spec vs the same mask as a tensor (every key read): the
    band of 2 * 8 + 1 keys of N = 512 costs a small fraction, and the outputs agree."""
    attn = MultiHeadAttention(32, 2, backend="chunked", chunk_size=64).eval()
    x = torch.randn(1, 512, 32)
    s = spec(window=8)
    flops = {}
    outs = {}
    for name, mask in {"banded": s, "dense": s.dense(512)}.items():
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            outs[name] = attn(x, mask=mask)
        flops[name] = counter.get_total_flops()
    torch.testing.assert_close(outs["banded"], outs["dense"], atol=1e-5, rtol=1e-5)
    projections = 2 * 512 * 32 * (3 * 32 + 32)
    assert flops["banded"] - projections < 0.3 * (flops["dense"] - projections)


# ---------------------------------------------------------------- the rule "auto" follows


def test_auto_rule():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    n = 4096
    assert auto_sparse(cpu, True, n, 64, 0.0) == auto_sparse(cpu, False, n, 64, 0.0) == "chunked"
    assert auto_sparse(cuda, True, n, 64, 0.0) == auto_sparse(cuda, False, n, 64, 0.0) == "flex"
    assert auto_sparse(cuda, True, n, 64, 0.1) == "chunked"  # flex has no dropout
    assert auto_sparse(cpu, True, BANDED_MIN_N - 1, 4, 0.0) is None  # small N: dense kernels
    assert auto_sparse(cpu, True, n, n // 8, 0.0) is None  # the band covers over a quarter of the keys


def test_auto_resolves_a_windowed_spec_to_the_banded_path_on_the_cpu():
    attn = _module("auto")
    x = torch.randn(1, BANDED_MIN_N, DIM)
    s = spec(window=16)
    assert attn.resolved_backend(mask=s, x=x) == "chunked"
    with torch.no_grad():
        assert attn.resolved_backend(mask=s, x=x) == "chunked"  # never flex on a CPU
    assert attn.resolved_backend(need_weights=True, mask=s, x=x) == "math"
    assert attn.resolved_backend(mask=spec(causal=True), x=x) == "sdpa"  # no window: dense
    assert attn.resolved_backend(mask=s.dense(BANDED_MIN_N), x=x) == "sdpa"  # a tensor: dense
    with zoo.attention_backend("math"):
        assert attn.resolved_backend(mask=s, x=x) == "math"  # an explicit setting wins
    attn.backend = "sdpa"
    assert attn.resolved_backend(mask=s, x=x) == "sdpa"  # so does an explicit backend


# ---------------------------------------------------------------- flex: refusals (no compile needed)


def test_flex_refuses_what_it_cannot_do():
    attn = _module("flex")
    x = torch.randn(2, 7, DIM)
    with pytest.raises(ValueError, match=r"no backward on the CPU.*backend='auto' or 'chunked'"):
        attn(x.requires_grad_(), mask=spec(window=2))
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"zoo.masks.spec.*torch.bool tensor.*backend='sdpa'"):
            attn(x, mask=spec(window=2).dense(7))
        dropping = _module("flex", attn_drop=0.1).train()
        with pytest.raises(ValueError, match=r"no attention dropout.*attn_drop=0.1"):
            dropping(x, mask=spec(window=2))
        assert attn.resolved_backend(need_weights=True) == "math"  # weights come from math, as for sdpa
        with pytest.raises(ValueError, match=r"float32, float16 or bfloat16, got torch.float64.*backend='math'"):
            _module("flex").double()(x.double())  # was an InductorError from the CPU kernel


@pytest.mark.parametrize("n, m", [(4, 0), (0, 4), (0, 0)], ids=["empty context", "no queries", "neither"])
def test_flex_with_zero_tokens_returns_what_math_returns(n, m):
    """No key: the attention output is 0, so the module returns proj.bias (torch.nn.MultiheadAttention's
    contract); no query: an empty (B, 0, dim). flex's kernel ended the process with a floating-point exception."""
    torch.manual_seed(0)
    attn = _module("flex").eval()
    x, context = torch.randn(2, n, DIM), torch.randn(2, m, DIM)
    with torch.no_grad():
        out = attn(x, context)
        attn.backend = "math"
        assert out.shape == (2, n, DIM)
        torch.testing.assert_close(out, attn.proj.bias.expand(2, n, DIM))
        torch.testing.assert_close(out, attn(x, context))


# ---------------------------------------------------------------- flex forward on the CPU (compiles)


def _flex_matches_math(module_kw: dict, mask_kw: dict, n: int, is_causal: bool = False):
    attn = MultiHeadAttention(32, 2, backend="math", **module_kw).eval()
    x = torch.randn(2, n, 32)
    s = spec(**mask_kw)
    with torch.no_grad():
        ref = attn(x, mask=s, is_causal=is_causal)
        attn.backend = "flex"
        out = attn(x, mask=s, is_causal=is_causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    empty = ~s.row_ok(n).expand(2, 1, n, 1)[:, 0, :, 0]
    torch.testing.assert_close(out[empty], attn.proj.bias.expand(int(empty.sum()), 32), atol=0, rtol=0)


def test_flex_forward_equals_math_on_the_cpu():
    """One compile: N = 150 spans two 128-row blocks; causal + window + lengths with an empty sequence. Another
    window and other lengths at the same shape reuse the compiled kernel (they are inputs, not constants)."""
    _flex_matches_math({}, dict(causal=True, window=40, lengths=[150, 0]), 150)
    graphs = counters["stats"]["unique_graphs"]
    _flex_matches_math({}, dict(causal=True, window=7, lengths=[90, 150]), 150)
    assert counters["stats"]["unique_graphs"] == graphs


def test_flex_is_right_for_key_counts_that_torchs_cpu_kernel_gets_wrong():
    """Heads of 16 channels and 8 modulo 16 keys, where torch 2.14's compiled CPU kernel returned wrong values or
    NaN: the backend gives the kernel 16k keys, the padding masked out, and matches "math"."""
    from zoo.layers.flex import padded_keys

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert padded_keys(40, 16, cpu) == padded_keys(33, 8, cpu) == padded_keys(48, 16, cpu) == 48
    assert padded_keys(40, 32, cpu) == padded_keys(40, 16, cuda) == 40
    _flex_matches_math({}, dict(window=5, lengths=[40, 9]), 40)


def test_flex_reuses_its_kernel_for_another_batch_size():
    """A mask without per-sequence lengths broadcasts over the batch: the batch dimension is compiled dynamic, so
    the last, partial batch of an epoch compiles nothing new."""
    attn = MultiHeadAttention(32, 2, backend="flex").eval()
    reference = MultiHeadAttention(32, 2, backend="math").eval()
    reference.load_state_dict(attn.state_dict())
    s = spec(causal=True, window=9)
    with torch.no_grad():
        attn(torch.randn(4, 150, 32), mask=s)
        graphs = counters["stats"]["unique_graphs"]
        for batch in (3, 6):  # (size 1 would specialise: torch compiles 0 and 1 apart)
            x = torch.randn(batch, 150, 32)
            torch.testing.assert_close(attn(x, mask=s), reference(x, mask=s), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_flex_forward_on_a_grid_with_relative_position_bias():
    _flex_matches_math(dict(rel_pos_grid=(5, 6)), dict(window=1, grid=(5, 6)), 30)


@pytest.mark.slow
def test_flex_forward_with_relative_position_bias_and_is_causal_at_a_second_n():
    """After another N with as many (padded) keys: torch's automatic dynamic shapes would compile a kernel with
    a dynamic N there, which returned wrong values with a position bias; the backend keeps N static."""
    _flex_matches_math(dict(rel_pos_grid=(5, 6)), dict(window=1, grid=(5, 6)), 30)
    _flex_matches_math(dict(rel_pos_grid=(4, 4), num_prefix_tokens=1), dict(window=5, lengths=[17, 9]), 17,
                       is_causal=True)


@pytest.mark.parametrize("precision", ["autocast_bf16", "fp16"])
def test_banded_fully_masked_rows_give_proj_bias_in_low_precision(precision):
    attn = _module("chunked").train()
    x = torch.randn(2, 9, DIM)
    s = spec(causal=True, window=2, lengths=[9, 0])  # batch 1: no key at all
    if precision == "fp16":
        attn, x = attn.half(), x.half()
    xg = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast_bf16"):
        out = attn(xg, mask=s)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1], attn.proj.bias.to(out.dtype).expand(9, DIM), atol=0, rtol=0)
    out.float().square().sum().backward()
    assert torch.isfinite(xg.grad).all() and all(torch.isfinite(p.grad).all() for p in attn.parameters())


def test_torch_export_takes_a_spec_on_the_banded_path():
    attn = _module("chunked").eval()
    x, s = torch.randn(2, 13, DIM), spec(causal=True, window=2, lengths=[13, 5])
    exported = torch.export.export(attn, (x,), {"mask": s}).module()  # the spec is a constant of the graph
    with torch.no_grad():
        torch.testing.assert_close(exported(x, mask=s), attn(x, mask=s), atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_torch_compile_of_a_flex_module():
    """The cached block mask is built outside the compiled graph (a graph break) and enters it as an input."""
    attn = MultiHeadAttention(32, 2, backend="flex").eval()
    x, s = torch.randn(2, 40, 32), spec(window=5, lengths=[40, 9])
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(attn)(x, mask=s), attn(x, mask=s), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "math", "chunked"])
def test_weights_with_a_spec_equal_weights_with_the_dense_mask(backend):
    attn = _module(backend).eval()
    x, s = torch.randn(2, 8, DIM), spec(causal=True, window=2, lengths=[8, 3])
    with torch.no_grad():
        out, weights = attn(x, mask=s, need_weights=True)
        ref_out, ref_weights = attn(x, mask=s.dense(8), need_weights=True)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
    assert (weights.masked_select(~s.dense(8).expand_as(weights)) == 0).all()
