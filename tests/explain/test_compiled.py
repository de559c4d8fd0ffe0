"""Explaining compiled models: recording and every method on a model whose blocks are compiled (``compile:
regions``, zoo.models.regions) and on ``torch.compile(model)`` give the eager model's maps; recording with
gradients from inside a compiled graph is refused in one line naming the fix. torch.compile costs tens of seconds
on a CPU: one tiny model in the default suite, the whole-model compile marked slow."""

from __future__ import annotations

import copy

import pytest
import torch

import zoo
from zoo.explain.methods import applicable_methods, attribute
from zoo.models.regions import compile_regions


def compare_with_eager(eager: torch.nn.Module, compiled: torch.nn.Module) -> None:
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        with zoo.record_attention(eager) as want:
            expected = eager(images)
        with zoo.record_attention(compiled) as got:
            logits = compiled(images)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert len(got.maps) == len(want.maps) > 0 and len(got.cbam) == len(want.cbam)
    for a, b in zip(got.maps + got.cbam, want.maps + want.cbam, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for method in applicable_methods(eager):
        torch.testing.assert_close(attribute(compiled, images, method, torch.tensor([1, 2])),
                                   attribute(eager, images, method, torch.tensor([1, 2])), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="compiled model; record its eager form.*zoo.explain.eager"):
        zoo.record_attention(compiled, keep_graph=True)


def test_regionally_compiled_vit_is_explained_as_the_eager_one():
    torch.manual_seed(0)
    eager = zoo.create_model("vit_nano", depth=1, embed_dim=32, num_heads=2).eval()
    compiled = copy.deepcopy(eager)
    assert compile_regions(compiled) == ["blocks.0"]
    compare_with_eager(eager, compiled)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["regions", "whole"])
def test_compiled_hybrid_is_explained_as_the_eager_one(how):
    torch.manual_seed(0)
    eager = zoo.create_model("hybrid_tiny").eval()
    compiled = copy.deepcopy(eager)
    if how == "regions":
        assert compile_regions(compiled)
    else:
        compiled = torch.compile(compiled)
    compare_with_eager(eager, compiled)
