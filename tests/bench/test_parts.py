"""zoo.bench.parts: the copies it times lack exactly the named blocks (the model itself keeps them), and its rows."""

from __future__ import annotations

import pytest
import torch

import zoo
from zoo.bench.parts import time_parts, without
from zoo.models.vit import Block


def small_hybrid():
    return zoo.create_model("hybrid_tiny", stem_chs=(8, 16), embed_dim=16, depth=2, num_heads=2).eval()


def test_without_replaces_every_block_of_the_class_in_a_copy():
    model = small_hybrid()
    stripped = without(model, "CBAM")
    assert sum(isinstance(m, zoo.CBAM) for m in stripped.modules()) == 0
    assert sum(isinstance(m, zoo.CBAM) for m in model.modules()) == 3
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():  # the stem without its gates: each group's output before the CBAM
        expected = model.forward_head(model.forward_features(x))
        groups = [torch.nn.Sequential(*list(g)[:-1]) for g in model.conv_stages]
        grid = torch.nn.Sequential(*model.stem[:model._STAGES_FROM], *groups)(x)
        tokens = model.norm(model.blocks(model.forward_tokens(grid)))
        torch.testing.assert_close(stripped(x), model.forward_head(tokens))
        torch.testing.assert_close(model(x), expected)
    assert sum(isinstance(m, Block) for m in without(model, "Block").modules()) == 0
    with pytest.raises(ValueError, match="has no Nope module"):
        without(model, "Nope")


def test_time_parts_rows():
    seconds = time_parts(small_hybrid(), ["CBAM", "Block"], batch=2, precision="32", repeats=1)
    assert set(seconds) == {"model", "without CBAM", "without Block", "optimizer"}
    assert all(t > 0 for t in seconds.values())
