"""Regional compilation (``zoo.models.compile_regions``): which blocks it compiles, that the model keeps its
parameter names and computes what the eager model computes, and the CBAM gradient that compiled bf16 code once
turned into NaN (a regression test at the shape where it happened)."""

from __future__ import annotations

import copy

import pytest
import torch

import zoo
from zoo.models import compile_regions


def test_compiles_each_cbam_and_block_once_and_keeps_the_names():
    model = zoo.create_model("hybrid_tiny")
    keys = list(model.state_dict())
    names = compile_regions(model)
    assert names == ["stem.3.7", "stem.4.7", "stem.5.7", "blocks.0", "blocks.1"]  # each conv group's CBAM, blocks
    assert list(model.state_dict()) == keys
    assert compile_regions(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []
    cbam = zoo.CBAM(8)
    assert compile_regions(cbam) == [""]  # a region itself: compiled whole, nothing inside it again


@pytest.mark.slow  # about a minute on 2 CPU cores; the default suite keeps smaller forms
def test_a_compiled_small_hybrid_equals_the_eager_one():
    """Forward and every parameter's gradient in fp32, against an eager copy with the same weights."""
    eager = zoo.create_model("hybrid_tiny", stem_chs=(8,), embed_dim=16, depth=1, num_heads=2).train()
    compiled = copy.deepcopy(eager)
    compile_regions(compiled)
    x = torch.randn(4, 3, 32, 32)
    outs = [m(x) for m in (eager, compiled)]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for out in outs:
        out.square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_compiled_cbam_gradient_is_finite_in_bf16():
    """A compiled CBAM's backward under bf16 autocast, at the first conv group's shape of hybrid_tiny: the spatial
    gate's channel maximum through ``amax`` gave NaN input gradients there (inductor compared the recomputed
    input with the saved maximum, found no equal element and divided by that count of zero)."""
    cbam = zoo.CBAM(64).to(memory_format=torch.channels_last)
    reference = copy.deepcopy(cbam)
    compile_regions(cbam)
    x = torch.randn(128, 64, 16, 16).to(torch.bfloat16, memory_format=torch.channels_last)
    grad = torch.randn_like(x)
    grads = []
    for module in (reference, cbam):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            module(leaf).backward(grad)
        grads.append(leaf.grad.float())
    assert torch.isfinite(grads[1]).all()
    # bf16 ties in the maximum may route an element's gradient elsewhere: compare where most elements agree
    close = torch.isclose(grads[1], grads[0], atol=0.05, rtol=0.05)
    assert close.float().mean() > 0.99


def test_cbam_compiled_with_its_neighbours_has_finite_gradients_in_bf16():
    """CBAM compiled in one graph with the conv before it and the head after it (as ``compile: true`` compiles the
    whole hybrid), backward under bf16 autocast: the channel gate's spatial maximum through ``amax`` gave NaN
    gradients there (every conv of hybrid_tiny's stem NaN after the first step, on the CPU and on CUDA); the
    gradients must be finite and those of the eager model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.GELU(),
                                zoo.CBAM(16, reduction=4), torch.nn.Flatten(), torch.nn.Linear(16 * 8 * 8, 10))
    model.to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (8,))
    grads = []
    for forward in (model, torch.compile(model)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            torch.nn.functional.cross_entropy(forward(x).float(), y).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, want in grads[0].items():
        got = grads[1][name]
        assert torch.isfinite(got).all(), name
        assert (got - want).norm() <= 0.05 * want.norm(), name
