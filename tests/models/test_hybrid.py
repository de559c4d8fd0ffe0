"""The hybrid CNN-attention models: grid and token shapes, the relative position bias, gradients, image-size
rules, timm conventions, and the cost claim in FLOPs against timm's ViT (its training speed is measured by the
benchmark suite, not asserted here)."""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

import zoo
from zoo.bench.suite import baseline_vit
from zoo.layers.whitening import PatchWhitening

NAMES = ["hybrid_tiny", "hybrid_small"]


@pytest.mark.parametrize("name", NAMES)
def test_stem_reaches_the_4x4_grid_and_tokens_flow(name):
    """Three conv groups (the last of width embed_dim), each halving the size and ending in a CBAM: 32 -> 4."""
    model = zoo.create_model(name).eval()
    x = torch.randn(2, 3, 32, 32)
    grid = model.forward_stem(x)
    assert grid.shape == (2, model.embed_dim, 4, 4) and model.grid_size == (4, 4)
    tokens = model.forward_features(x)
    assert tokens.shape == (2, 16, model.embed_dim)
    assert model(x).shape == (2, 10)
    assert model.forward_head(tokens, pre_logits=True).shape == (2, model.embed_dim)
    assert sum(isinstance(m, zoo.CBAM) for m in model.stem.modules()) == 3


def test_tokens_are_the_grid_read_row_major():
    model = zoo.create_model("hybrid_tiny", stem_chs=(16,), embed_dim=32, depth=0).eval()  # 8x8, no blocks
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        grid = model.forward_stem(x)
        tokens = model.forward_features(x)
    row, col = 2, 5
    torch.testing.assert_close(tokens[0, row * 8 + col], model.norm(grid[0, :, row, col]))


def test_relative_position_bias_is_on_and_used():
    model = zoo.create_model("hybrid_tiny").eval()
    attns = [m for m in model.modules() if isinstance(m, zoo.MultiHeadAttention)]
    assert len(attns) == len(model.blocks) == 2
    assert all(a.rel_pos_bias is not None and a.rel_pos_bias.grid == (4, 4) for a in attns)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
        table = attns[0].rel_pos_bias.relative_position_bias_table
        table.copy_(torch.linspace(-3, 3, table.numel()).reshape(table.shape))
        assert not torch.allclose(model(x), before, atol=1e-4)
    assert model.no_weight_decay() == {f"blocks.{i}.attn.rel_pos_bias.relative_position_bias_table"
                                       for i in range(2)}


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_gets_a_gradient(name):
    model = zoo.create_model(name, num_classes=3, drop_path_rate=0.1)
    loss = nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 0]))
    loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert dead == []


def test_drop_path_rises_linearly_to_the_rate():
    model = zoo.create_model("hybrid_tiny", drop_path_rate=0.2, depth=3)
    rates = [getattr(b.drop_path, "drop_prob", 0.0) for b in model.blocks]
    assert rates == pytest.approx([0.0, 0.1, 0.2])


def test_other_sizes_and_channels():
    model = zoo.create_model("hybrid_tiny", img_size=48, in_chans=1, num_classes=4)
    assert model.grid_size == (6, 6)
    assert model.forward_stem(torch.randn(2, 1, 48, 48)).shape[-2:] == (6, 6)
    assert model(torch.randn(2, 1, 48, 48)).shape == (2, 4)
    assert zoo.create_model("hybrid_tiny", img_size=(16, 24))(torch.randn(1, 3, 16, 24)).shape == (1, 10)


@pytest.mark.parametrize("img_size", [30, 4, 0, (32, 28)])
def test_img_size_not_a_multiple_of_8_raises(img_size):
    with pytest.raises(ValueError, match="multiple of 8"):
        zoo.create_model("hybrid_tiny", img_size=img_size)


@pytest.mark.parametrize("shape", [(2, 3, 64, 64), (2, 1, 32, 32), (3, 32, 32)])
def test_wrong_input_raises(shape):
    with pytest.raises(ValueError, match=r"\(B, 3, 32, 32\)"):
        zoo.create_model("hybrid_tiny")(torch.randn(shape))


def test_timm_conventions():
    x = torch.randn(2, 3, 32, 32)
    model = zoo.create_model("hybrid_tiny", num_classes=0)
    assert model(x).shape == (2, 256) == (2, model.num_features)
    model.reset_classifier(6)
    assert model(x).shape == (2, 6)
    model = timm.create_model("zoo_hybrid_tiny", num_classes=5)
    assert model(x).shape == (2, 5)
    assert model.pretrained_cfg["first_conv"] == "stem.0"
    assert isinstance(model.get_submodule(model.pretrained_cfg["first_conv"]), PatchWhitening)


def test_learns_a_small_batch():
    """A few AdamW steps fit 16 random images to random labels: the whole stack trains."""
    model = zoo.create_model("hybrid_tiny")
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


def test_hybrid_tiny_costs_less_than_the_vits():
    """FLOPs per image below the issue's CPU baseline ViT (width 192, depth 6, patch 4) and under half of
    ``vit_tiny``'s. The speed claim itself is a timing: ``python eval.py --bench-suite`` measures it
    (zoo.bench.suite.bench_hybrid_vs_vit)."""
    hybrid = zoo.model_info(zoo.create_model("hybrid_tiny"))["flops"]
    assert hybrid < zoo.model_info(baseline_vit(), input_size=(3, 32, 32))["flops"]
    assert hybrid < 0.5 * zoo.model_info(zoo.create_model("vit_tiny"))["flops"]
