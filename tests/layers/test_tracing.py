"""The building blocks under torch.fx symbolic tracing (the graph reproduces eager bit for bit) and torch.export,
with the input checks still raising in eager mode once a trace is done."""

from __future__ import annotations

import pytest
import torch

import zoo

BLOCKS = {
    "self": lambda: zoo.MultiHeadAttention(32, 4),
    "rel_bias_prefix": lambda: zoo.MultiHeadAttention(32, 4, rel_pos_grid=(3, 3), num_prefix_tokens=1),
    "math": lambda: zoo.MultiHeadAttention(32, 4, backend="math", rel_pos_grid=(3, 3), num_prefix_tokens=1),
    "cbam": lambda: zoo.CBAM(32, reduction=4),
}


# traced as the root, every forward argument would be a placeholder: the options are fixed as FX wants it
OPTIONS = dict(mask=None, is_causal=False, need_weights=False, kv_cache=None)


def trace(block: torch.nn.Module, **concrete) -> torch.fx.GraphModule:
    if isinstance(block, zoo.MultiHeadAttention):
        concrete = {"context": None, **OPTIONS, **concrete}
    return torch.fx.symbolic_trace(block, concrete_args=concrete or None)


def inputs(name: str) -> torch.Tensor:
    return torch.randn(2, 32, 6, 6) if name == "cbam" else torch.randn(2, 10, 32)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_traces_and_exports(name):
    block, x = BLOCKS[name]().eval(), inputs(name)
    traced = trace(block)
    exported = torch.export.export(block, (x,)).module()
    with torch.no_grad():
        assert torch.equal(traced(x), block(x))
        torch.testing.assert_close(exported(x), block(x), rtol=0, atol=1e-5)


def test_cross_attention_traces():
    attn = zoo.MultiHeadAttention(32, 4, context_dim=16).eval()
    x, context = torch.randn(2, 5, 32), torch.randn(2, 7, 16)
    traced = torch.fx.symbolic_trace(attn, concrete_args=OPTIONS)
    with torch.no_grad():
        assert torch.equal(traced(x, context), attn(x, context))


@pytest.mark.parametrize("name", list(BLOCKS))
def test_checks_still_raise_in_eager_mode_after_tracing(name):
    block = BLOCKS[name]()
    trace(block)
    with pytest.raises(ValueError, match="shape"):
        block(torch.randn(2, 5, 31) if name != "cbam" else torch.randn(2, 31, 6, 6))
    assert not zoo.layers.checks.tracing()


def test_checks_raise_with_the_model_input():
    model = zoo.create_model("vit_nano")
    torch.fx.symbolic_trace(model)
    with pytest.raises(ValueError, match=r"\(B, 3, 32, 32\), got \(1, 3, 16, 16\)"):
        model(torch.randn(1, 3, 16, 16))
