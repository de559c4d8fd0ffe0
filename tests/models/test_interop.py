"""zoo.interop against timm itself: equal logits both ways for random architectures and random weights,
position embeddings resampled as timm's own ``set_input_size`` does, and a ValueError for every timm feature
the zoo lacks."""

from __future__ import annotations

import copy
import random

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer

import zoo
from zoo.interop import vit_from_timm, vit_to_timm
from zoo.models.vit import VisionTransformer


def randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights everywhere (LayerNorm gains and biases too) so a missed copy shows in the logits."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def random_config(seed: int) -> dict:
    rng = random.Random(seed)
    num_heads = rng.choice([1, 2, 4])
    patch = rng.choice([4, 8])
    pool = rng.choice(["token", "avg"])
    return dict(img_size=rng.choice([16, 32]) if patch == 4 else 32, patch_size=patch,
                in_chans=rng.choice([1, 3]), num_classes=rng.choice([0, 7]), global_pool=pool,
                class_token=pool == "token", embed_dim=num_heads * rng.choice([8, 16]),
                depth=rng.randint(1, 3), num_heads=num_heads, mlp_ratio=rng.choice([1.5, 2.0, 4.0]),
                qkv_bias=rng.random() < 0.5)


def images(vit, batch: int = 2, size=None) -> torch.Tensor:
    pe = vit.patch_embed
    return torch.randn(batch, pe.proj.in_channels, *(size or pe.img_size))


@pytest.mark.parametrize("seed", range(6))
def test_equal_logits_both_ways(seed):
    config = random_config(seed)
    timm_vit = randomise(TimmVisionTransformer(**config))
    x = images(timm_vit)
    expected = timm_vit(x)
    zoo_vit = vit_from_timm(timm_vit)
    assert isinstance(zoo_vit, VisionTransformer) and not zoo_vit.training
    torch.testing.assert_close(zoo_vit(x), expected, atol=1e-5, rtol=1e-5)
    back = vit_to_timm(zoo_vit)
    assert type(back) is TimmVisionTransformer
    torch.testing.assert_close(back(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(), dict(global_pool="avg"), dict(pos_embed="sincos", num_classes=0)])
def test_zoo_to_timm_equal_logits(kwargs):
    zoo_vit = randomise(VisionTransformer(embed_dim=32, depth=2, num_heads=4, **kwargs))
    if kwargs.get("pos_embed") == "sincos":  # the fixed table is a buffer, randomise() left it alone
        assert zoo_vit.pos_embed[0, 0].abs().sum() == 0
    x = images(zoo_vit)
    torch.testing.assert_close(vit_to_timm(zoo_vit)(x), zoo_vit(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_register_tokens_equal_logits_both_ways(pool):
    timm_vit = randomise(TimmVisionTransformer(img_size=(16, 24), patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                               reg_tokens=4, global_pool=pool, class_token=pool == "token"))
    x = images(timm_vit)
    zoo_vit = vit_from_timm(timm_vit)
    assert zoo_vit.num_prefix_tokens == timm_vit.num_prefix_tokens == (5 if pool == "token" else 4)
    torch.testing.assert_close(zoo_vit(x), timm_vit(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vit_to_timm(zoo_vit)(x), timm_vit(x), atol=1e-5, rtol=1e-5)


def test_dropout_rates_carry_over():
    timm_vit = TimmVisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=3, num_heads=2,
                                     drop_rate=0.1, attn_drop_rate=0.2, proj_drop_rate=0.3,
                                     drop_path_rate=0.4)
    zoo_vit = vit_from_timm(timm_vit)
    assert zoo_vit.head_drop.p == 0.1 and zoo_vit.blocks[0].attn.attn_drop == 0.2
    assert zoo_vit.blocks[0].attn.proj_drop.p == 0.3
    assert zoo_vit.blocks[-1].drop_path.drop_prob == pytest.approx(0.4)
    back = vit_to_timm(zoo_vit)
    assert back.blocks[1].drop_path1.drop_prob == pytest.approx(timm_vit.blocks[1].drop_path1.drop_prob)


def test_from_timm_at_another_img_size_matches_timm_set_input_size():
    timm_vit = randomise(TimmVisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2))
    resized = copy.deepcopy(timm_vit)
    resized.set_input_size(img_size=(48, 48))  # timm's own resampling path
    zoo_vit = vit_from_timm(timm_vit, img_size=48)
    assert zoo_vit.img_size == (48, 48) and zoo_vit.grid_size == (12, 12)
    x = torch.randn(2, 3, 48, 48)
    torch.testing.assert_close(zoo_vit(x), resized(x), atol=1e-5, rtol=1e-5)


def test_to_timm_at_another_img_size_resamples():
    zoo_vit = randomise(VisionTransformer(embed_dim=32, depth=2, num_heads=2))
    timm_vit = vit_to_timm(zoo_vit, img_size=(16, 24))
    assert timm_vit.patch_embed.grid_size == (4, 6)
    reference = copy.deepcopy(vit_to_timm(zoo_vit))
    reference.set_input_size(img_size=(16, 24))
    x = torch.randn(2, 3, 16, 24)
    torch.testing.assert_close(timm_vit(x), reference(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="divisible"):
        vit_to_timm(zoo_vit, img_size=30)


@pytest.mark.parametrize("pos_embed", ["learn", "sincos"])
def test_dynamic_img_size_gives_timms_logits_at_every_size(pos_embed):
    """timm's dynamic_img_size ViT is the reference: at its own grid and at others (smaller, larger, not square)
    the zoo ViT made from it gives the same logits, both ways; a sin-cos table travels as timm's learned one."""
    zoo_vit = randomise(VisionTransformer(embed_dim=32, depth=2, num_heads=2, pos_embed=pos_embed,
                                          dynamic_img_size=True)).eval()
    timm_vit = vit_to_timm(zoo_vit)
    assert timm_vit.dynamic_img_size
    back = vit_from_timm(timm_vit).eval()
    assert back.dynamic_img_size
    for size in [(32, 32), (16, 16), (40, 40), (16, 24)]:
        x = torch.randn(2, 3, *size)
        torch.testing.assert_close(back(x), timm_vit(x), atol=1e-5, rtol=1e-5)
        if pos_embed == "learn" or size == (32, 32):  # elsewhere the zoo computes sin-cos, timm resamples it
            torch.testing.assert_close(zoo_vit(x), timm_vit(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, feature", [
    (dict(init_values=1e-5), "LayerScale"),
    (dict(qk_norm=True), "qk_norm"),
    (dict(no_embed_class=True), "no_embed_class"),
    (dict(global_pool="avg"), "class_token=True with global_pool='avg'"),
    (dict(global_pool="avg", class_token=False, fc_norm=False), "fc_norm"),
    (dict(pre_norm=True), "pre_norm"),
    (dict(global_pool="max", class_token=False), "global_pool='max'"),
    (dict(pos_embed="none"), "pos_embed='none'"),
    (dict(act_layer="gelu_tanh"), "act_layer"),
    (dict(norm_layer="rmsnorm"), "norm_layer"),
    (dict(proj_bias=False), "proj_bias=False"),
])
def test_unsupported_timm_features_raise(kwargs, feature):
    timm_vit = TimmVisionTransformer(**{**dict(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2),
                                        **kwargs})
    with pytest.raises(ValueError, match="no equivalent of these timm ViT features") as err:
        vit_from_timm(timm_vit)
    assert feature in str(err.value)


def test_several_unsupported_features_are_all_named():
    timm_vit = TimmVisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2,
                                     init_values=1e-5, qk_norm=True, no_embed_class=True)
    with pytest.raises(ValueError, match="no_embed_class=True.*LayerScale.*qk_norm"):
        vit_from_timm(timm_vit)


def test_unsupported_in_either_direction():
    with pytest.raises(ValueError, match="relative position bias"):
        vit_to_timm(VisionTransformer(embed_dim=32, depth=1, num_heads=2, rel_pos_bias=True))
    with pytest.raises(ValueError, match="VisionTransformer"):
        vit_from_timm(timm.create_model("resnet18", pretrained=False))
    with pytest.raises(ValueError, match="zoo VisionTransformer"):
        vit_to_timm(torch.nn.Linear(2, 2))


def test_default_vit_parameter_count_equals_timm():
    ours = zoo.create_model("vit_tiny")
    theirs = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
                               num_classes=10)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == 5_362_762
    assert ours.state_dict().keys() == theirs.state_dict().keys()


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_patch_dropout_in_training_equals_timms(pool):
    """patch_drop_rate: in training both models keep the same random tokens for the same seed (timm's
    PatchDropout is the reference); the blocks see 1 + int(64 * 0.5) tokens; evaluation sees all 65."""
    zoo_vit = randomise(VisionTransformer(embed_dim=32, depth=2, num_heads=2, global_pool=pool,
                                          patch_drop_rate=0.5)).train()
    timm_vit = vit_to_timm(zoo_vit)
    assert timm_vit.patch_drop.prob == 0.5 and vit_from_timm(timm_vit).patch_drop.prob == 0.5
    seen = []
    zoo_vit.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    x = images(zoo_vit, batch=3)
    torch.manual_seed(7)
    ours = zoo_vit(x)
    torch.manual_seed(7)
    torch.testing.assert_close(ours, timm_vit(x), atol=1e-5, rtol=1e-5)
    zoo_vit.eval()
    timm_vit.eval()
    torch.testing.assert_close(zoo_vit(x), timm_vit(x), atol=1e-5, rtol=1e-5)
    prefix = 1 if pool == "token" else 0
    assert seen == [prefix + 32, prefix + 64]  # training, then evaluation


@pytest.mark.parametrize("kwargs, match", [
    (dict(patch_drop_rate=1.0), r"\[0, 1\)"), (dict(patch_drop_rate=-0.1), r"\[0, 1\)"),
    (dict(patch_drop_rate="0.5"), r"\[0, 1\)"),
    (dict(patch_drop_rate=0.5, rel_pos_bias=True), "rel_pos_bias"),
    (dict(patch_drop_rate=0.5, local_window=1, global_pool="avg"), "local_window"),
])
def test_patch_dropout_refused_where_it_cannot_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VisionTransformer(embed_dim=32, depth=1, num_heads=2, **kwargs)
