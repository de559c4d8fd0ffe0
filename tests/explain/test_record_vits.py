"""record_attention on ViTs that are not the zoo's: timm's VisionTransformer (fused and non-fused attention)
against its zoo conversion, torchvision's VisionTransformer against a recomputation with torch ops, and
keep_graph recordings that leave the outputs unchanged and carry gradients."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
from einops import rearrange

import zoo
from zoo.explain.methods import attribute
from zoo.interop import vit_from_timm


def timm_vit(fused: bool) -> torch.nn.Module:
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, num_classes=10, depth=2).eval()
    for block in model.blocks:
        block.attn.fused_attn = fused
    return model


def torchvision_vit() -> torch.nn.Module:
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=4, num_layers=2, num_heads=3,
                                                 hidden_dim=48, mlp_dim=96, num_classes=10).eval()
    torch.nn.init.normal_(model.heads.head.weight, std=0.5)  # torchvision zero-inits the head: no gradients
    return model


@pytest.mark.parametrize("fused", [True, False])
def test_timm_vit_maps_equal_its_zoo_conversion(fused):
    model = timm_vit(fused)
    converted = vit_from_timm(model).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        plain = model(images)
        with zoo.record_attention(model) as rec:
            logits = model(images)
        with zoo.record_attention(converted) as ref:
            converted(images)
    assert len(rec.maps) == 2 and rec.num_prefix_tokens == 1
    for got, want in zip(rec.maps, ref.maps, strict=True):
        assert got.shape == (2, 3, 65, 65)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)
    assert all(block.attn.fused_attn is fused for block in model.blocks)  # restored


def torchvision_reference_maps(model, images) -> list[torch.Tensor]:
    """Each encoder layer's weights recomputed with torch ops from its packed in_proj."""
    x = model._process_input(images)
    x = torch.cat([model.class_token.expand(len(x), -1, -1), x], dim=1) + model.encoder.pos_embedding
    maps = []
    for layer in model.encoder.layers:
        attn = layer.self_attention
        h = layer.ln_1(x)
        q, k, _ = rearrange(torch.nn.functional.linear(h, attn.in_proj_weight, attn.in_proj_bias),
                            "b n (three heads d) -> three b heads n d", three=3, heads=attn.num_heads)
        maps.append((q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(dim=-1))
        x = layer(x)
    return maps


def test_torchvision_vit_maps_against_torch_ops():
    model = torchvision_vit()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        plain = model(images)
        with zoo.record_attention(model) as rec:
            logits = model(images)
        expected = torchvision_reference_maps(model, images)
    assert len(rec.maps) == 2 and rec.num_prefix_tokens == 1
    for got, want in zip(rec.maps, expected, strict=True):
        assert got.shape == (2, 3, 65, 65)
        torch.testing.assert_close(got.sum(-1), torch.ones(2, 3, 65))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)
    assert not model.encoder.layers[0].self_attention._forward_hooks  # hooks removed


@pytest.mark.parametrize("make", [lambda: timm_vit(True), torchvision_vit,
                                  lambda: zoo.create_model("vit_nano").eval()], ids=["timm", "torchvision", "zoo"])
def test_keep_graph_recording_keeps_outputs_and_carries_gradients(make):
    model = make()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        plain = model(images)
    with zoo.record_attention(model, keep_graph=True) as rec:
        logits = model(images)
        grads = torch.autograd.grad(logits[:, 3].sum(), rec.maps)
    torch.testing.assert_close(logits.detach(), plain, atol=1e-5, rtol=1e-5)
    assert all(g.shape == a.shape and g.abs().sum() > 0 for g, a in zip(grads, rec.maps, strict=True))


def test_every_vit_explained_by_the_same_call():
    images = torch.randn(2, 3, 32, 32)
    for model in (timm_vit(True), torchvision_vit(), zoo.create_model("vit_nano").eval()):
        for method in ("raw_attention", "rollout", "grad_rollout", "chefer2021"):
            heatmap = attribute(model, images, method)
            assert heatmap.shape == (2, 8, 8) and torch.isfinite(heatmap).all()
