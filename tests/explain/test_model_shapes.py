"""Explanations on ViTs shaped unlike the plain one, each a small randomly initialised timm model (no download):
register tokens and DeiT's distillation token (prefix handling against maps sliced and rolled out by hand), EVA
(rotary attention, a non-square grid), CaiT (class attention: raw attention only, the rest refused in one line)
and Swin (windowed attention: refused in one line); every method's map on the model's own grid."""

from __future__ import annotations

import pytest
import timm
import torch

import zoo
from zoo.explain.methods import applicable_methods, attribute
from zoo.explain.rollout import attention_rollout, fuse_heads


def small(name: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=10, **kwargs).eval()


def register_vit() -> torch.nn.Module:
    return small("vit_tiny_patch16_224", img_size=(32, 48), patch_size=8, depth=2, embed_dim=48, num_heads=3,
                 reg_tokens=4)


def no_attention_to_registers(module, args, kwargs):
    """Forward pre-hook of a timm Attention: no query attends to a register token (columns 1..4) but the
    register itself, so the class and patch tokens form a closed system."""
    x = args[0]
    n = x.shape[1]
    mask = torch.zeros(n, n)
    mask[:, 1:5] = float("-inf")
    mask[range(1, 5), range(1, 5)] = 0.0
    return args, {**kwargs, "attn_mask": mask}


@pytest.mark.parametrize("method", ["rollout", "raw_attention"])
def test_register_tokens_are_left_out_of_the_map(method):
    model = register_vit()
    handles = [b.attn.register_forward_pre_hook(no_attention_to_registers, with_kwargs=True) for b in model.blocks]
    images = torch.randn(2, 3, 32, 48)
    got = attribute(model, images, method)
    with torch.no_grad(), zoo.record_attention(model) as rec:
        model(images)
    for h in handles:
        h.remove()
    keep = [0, *range(5, 5 + 4 * 6)]  # the class token and the 4x6 patches: registers removed by hand
    maps = [a[:, :, keep][:, :, :, keep] for a in rec.maps]
    assert rec.num_prefix_tokens == 5 and got.shape == (2, 4, 6)
    relevance = attention_rollout(maps, num_prefix_tokens=1) if method == "rollout" else fuse_heads(maps[-1])
    torch.testing.assert_close(got, relevance[:, 0, 1:].reshape(2, 4, 6), atol=1e-6, rtol=1e-5)


def test_distilled_vit_reads_the_patches_after_both_prefix_tokens():
    model = small("deit_tiny_distilled_patch16_224", img_size=32, patch_size=4, depth=2, embed_dim=48, num_heads=3)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), zoo.record_attention(model) as rec:
        model(images)
    assert rec.num_prefix_tokens == 2 and rec.maps[0].shape[-1] == 2 + 64
    expected = attention_rollout(list(rec.maps), num_prefix_tokens=2)[:, 0, 2:].reshape(2, 8, 8)
    torch.testing.assert_close(attribute(model, images, "rollout"), expected)
    grid = {m: tuple(attribute(model, images, m).shape[1:]) for m in applicable_methods(model)}
    pixels = {"attnlrp": (32, 32), "edges": (32, 32)}  # input-level methods: the image's resolution
    assert grid == {m: pixels.get(m, (8, 8)) for m in ("raw_attention", "rollout", "grad_rollout", "chefer2021",
                                                       "attnlrp", "gradcam", "random", "centre", "edges")}


def test_eva_is_recorded_on_its_non_square_grid():
    model = small("eva02_tiny_patch14_224", img_size=(28, 42), patch_size=7, depth=2, embed_dim=48, num_heads=3)
    images = torch.randn(2, 3, 28, 42)
    with torch.no_grad():
        plain = model(images)
        with zoo.record_attention(model) as rec:
            logits = model(images)
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)
    assert len(rec.maps) == 2 and rec.maps[0].shape == (2, 3, 25, 25)
    torch.testing.assert_close(rec.maps[0].sum(-1), torch.ones(2, 3, 25))
    assert model.global_pool == "avg"  # EVA-02 averages the patch tokens: the map is the patch rows' mean
    expected = attention_rollout(rec.maps)[:, 1:, 1:].mean(1).reshape(2, 4, 6)
    torch.testing.assert_close(attribute(model, images, "rollout"), expected)
    methods = applicable_methods(model)
    assert methods == ["raw_attention", "rollout", "grad_rollout", "chefer2021", "attnlrp", "gradcam", "random",
                       "centre", "edges"]
    pixels = {"attnlrp", "edges"}  # input-level methods: the image's resolution
    assert all(attribute(model, images, m).shape == ((2, 28, 42) if m in pixels else (2, 4, 6)) for m in methods)


def test_cait_class_attention_gives_raw_attention_and_refuses_rollout():
    model = small("cait_xxs24_224", img_size=32, patch_size=4, depth=2, depth_token_only=1, embed_dim=48,
                  num_heads=3)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), zoo.record_attention(model) as rec:
        model(images)
    class_rows = rec.maps[-1]  # the class-attention block: the class token queries 1 + 64 tokens
    assert class_rows.shape == (2, 3, 1, 65)
    torch.testing.assert_close(class_rows.sum(-1), torch.ones(2, 3, 1))
    assert applicable_methods(model) == ["raw_attention", "gradcam", "random", "centre", "edges"]
    torch.testing.assert_close(attribute(model, images, "raw_attention"),
                               class_rows.mean(1)[:, 0, 1:].reshape(2, 8, 8))
    assert attribute(model, images, "gradcam").shape == attribute(model, images, "random").shape == (2, 8, 8)
    with pytest.raises(ValueError, match="rollout needs attention maps .* methods that apply: raw_attention, "
                       "gradcam, random, centre, edges"):
        attribute(model, images, "rollout")


def test_windowed_attention_is_refused_naming_the_methods_that_apply():
    model = small("swin_tiny_patch4_window7_224", img_size=32, window_size=4, embed_dim=24, depths=(1, 1),
                  num_heads=(1, 2))
    with pytest.raises(ValueError,
                       match=r"^chefer2021 needs attention maps .*methods that apply: random, centre, edges$"):
        attribute(model, torch.randn(1, 3, 32, 32), "chefer2021")


def test_random_is_on_the_model_grid():
    images = torch.randn(3, 3, 32, 32)
    assert attribute(zoo.create_model("hybrid_tiny").eval(), images, "random").shape == (3, 4, 4)
    assert attribute(zoo.create_model("vit_nano").eval(), images, "random").shape == (3, 8, 8)
    assert attribute(zoo.create_model("resnet18").eval(), images, "random", grid=(5, 7)).shape == (3, 5, 7)
