"""zoo.models.vit against independent references: timm's Block and VisionTransformer, unfold-based patch
extraction, torch's bicubic interpolation, and hand-written pooling / stochastic-depth rules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block as TimmBlock
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer
from torch import nn

import zoo
from zoo.models.vit import Block, PatchEmbed, VisionTransformer


def small_vit(**kwargs) -> VisionTransformer:
    return VisionTransformer(**{**dict(embed_dim=32, depth=2, num_heads=2), **kwargs})


def test_parameter_names_and_count_equal_timm():
    zoo_vit = small_vit(mlp_ratio=3.0)
    timm_vit = TimmVisionTransformer(img_size=32, patch_size=4, num_classes=10, embed_dim=32, depth=2,
                                     num_heads=2, mlp_ratio=3.0)
    assert {k: v.shape for k, v in zoo_vit.state_dict().items()} == \
           {k: v.shape for k, v in timm_vit.state_dict().items()}


def test_attributes():
    vit = small_vit(img_size=(32, 48), patch_size=(4, 8))
    assert (vit.img_size, vit.patch_size, vit.grid_size, vit.in_chans) == ((32, 48), (4, 8), (8, 6), 3)
    assert vit.num_prefix_tokens == 1 and vit.global_pool == "token"
    assert vit(torch.randn(1, 3, 32, 48)).shape == (1, 10)
    assert small_vit(global_pool="avg").num_prefix_tokens == 0


def test_patch_embed_equals_unfold_and_linear():
    embed = PatchEmbed(img_size=16, patch_size=4, in_chans=3, embed_dim=8)
    x = torch.randn(2, 3, 16, 16)
    patches = F.unfold(x, kernel_size=4, stride=4).transpose(1, 2)  # (B, 16, 3*4*4), row-major grid
    expected = patches @ embed.proj.weight.flatten(1).T + embed.proj.bias
    torch.testing.assert_close(embed(x), expected, atol=1e-5, rtol=1e-5)


def test_block_equals_timm_block():
    ours = Block(32, 4, mlp_ratio=2.0).eval()
    ref = TimmBlock(32, 4, mlp_ratio=2.0, qkv_bias=True).eval()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 10, 32)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_block_takes_attention_layer_and_kwargs():
    blk = Block(32, 2, attn_kwargs=dict(rel_pos_grid=(2, 2), num_prefix_tokens=1, backend="math"))
    assert blk.attn.backend == "math" and blk.attn.rel_pos_bias.grid == (2, 2)

    class Recording(zoo.MultiHeadAttention):
        calls = 0

        def forward(self, x, *args, **kwargs):
            Recording.calls += 1
            return super().forward(x, *args, **kwargs)

    blk = Block(32, 2, attn_layer=Recording)
    blk(torch.randn(1, 5, 32))
    assert Recording.calls == 1


def test_avg_pool_is_mean_of_patch_tokens_then_fc_norm():
    vit = small_vit(global_pool="avg").eval()
    assert vit.cls_token is None and isinstance(vit.norm, nn.Identity)
    assert isinstance(vit.fc_norm, nn.LayerNorm)
    x = torch.randn(2, 3, 32, 32)
    tokens = vit.forward_features(x)
    assert tokens.shape == (2, 64, 32)
    pooled = F.layer_norm(tokens.mean(1), (32,), vit.fc_norm.weight, vit.fc_norm.bias, eps=1e-6)
    torch.testing.assert_close(vit(x), F.linear(pooled, vit.head.weight, vit.head.bias), atol=1e-5, rtol=1e-5)


def test_token_pool_reads_class_token():
    vit = small_vit().eval()
    x = torch.randn(2, 3, 32, 32)
    tokens = vit.forward_features(x)
    assert tokens.shape == (2, 65, 32)
    torch.testing.assert_close(vit(x), F.linear(tokens[:, 0], vit.head.weight, vit.head.bias))


def test_reset_classifier_switches_pooling():
    vit = small_vit().eval()
    x = torch.randn(2, 3, 32, 32)
    tokens = vit.forward_features(x)
    vit.reset_classifier(0, global_pool="avg")
    torch.testing.assert_close(vit(x), tokens[:, 1:].mean(1))
    with pytest.raises(ValueError, match="class token"):
        small_vit(global_pool="avg").reset_classifier(5, global_pool="token")
    with pytest.raises(ValueError, match="'token' or 'avg'"):
        vit.reset_classifier(5, global_pool="max")


@pytest.mark.parametrize("kwargs, match", [
    (dict(img_size=30), r"divisible by patch_size"),
    (dict(global_pool="max"), "'token' or 'avg'"),
    (dict(pos_embed="rope"), "'learn' or 'sincos'"),
    (dict(num_heads=5), "divisible by num_heads"),
    (dict(dynamic_img_size=True, rel_pos_bias=True), "dynamic_img_size .* rel_pos_bias"),
    (dict(dynamic_img_size=True, local_window=1, global_pool="avg"), "dynamic_img_size .* local_window"),
])
def test_bad_construction_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        small_vit(**kwargs)


@pytest.mark.parametrize("shape", [(1, 3, 64, 64), (1, 3, 32, 28), (1, 1, 32, 32), (3, 32, 32)])
def test_wrong_input_raises_naming_both(shape):
    vit = small_vit()
    with pytest.raises(ValueError, match=r"expected images of shape \(B, C, H, W\)") as err:
        vit(torch.randn(shape))
    assert "(B, 3, 32, 32)" in str(err.value) and str(tuple(shape)) in str(err.value)


def test_dynamic_img_size_takes_sizes_divisible_by_the_patch():
    vit = small_vit(dynamic_img_size=True).eval()
    for size in [(16, 16), (32, 32), (48, 24)]:
        assert vit(torch.randn(2, 3, *size)).shape == (2, 10)
    with pytest.raises(ValueError, match=r"image size \(30, 32\) must be divisible by patch_size \(4, 4\)"):
        vit(torch.randn(1, 3, 30, 32))


def test_dynamic_sincos_at_another_grid_is_the_model_built_for_it():
    """A sin-cos table is computed for the input's grid: the same weights built at 16 x 24 give the same logits."""
    vit = small_vit(pos_embed="sincos", dynamic_img_size=True).eval()
    built = small_vit(pos_embed="sincos", img_size=(16, 24)).eval()
    built.load_state_dict(vit.state_dict())
    x = torch.randn(2, 3, 16, 24)
    torch.testing.assert_close(vit(x), built(x))


def test_sincos_pos_embed_is_fixed():
    vit = small_vit(pos_embed="sincos")
    assert "pos_embed" not in vit.state_dict() and "pos_embed" not in dict(vit.named_parameters())
    table = vit.pos_embed[0]
    assert table.shape == (65, 32) and torch.equal(table[0], torch.zeros(32))
    # row-major grid: tokens 1 and 2 share a row (first half of channels), tokens 1 and 9 share a column
    torch.testing.assert_close(table[1, :16], table[2, :16])
    torch.testing.assert_close(table[1, 16:], table[9, 16:])
    assert not torch.allclose(table[1], table[2])


def test_rel_pos_bias_in_every_block_and_trained():
    vit = small_vit(rel_pos_bias=True)
    biases = [blk.attn.rel_pos_bias for blk in vit.blocks]
    assert all(b.grid == (8, 8) and b.num_prefix_tokens == 1 for b in biases)
    # all tokens: with token pooling the last block's bias only moves patch rows, which the head never reads
    vit.forward_features(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all(b.relative_position_bias_table.grad.abs().sum() > 0 for b in biases)


def test_backend_reaches_every_block_and_backends_agree():
    x = torch.randn(2, 3, 32, 32)
    vit = small_vit(backend="math").eval()
    assert all(blk.attn.backend == "math" for blk in vit.blocks)
    ref = vit(x)
    for blk in vit.blocks:
        blk.attn.backend = "chunked"
    torch.testing.assert_close(vit(x), ref, atol=1e-5, rtol=1e-5)


def test_stochastic_depth_linear_rule_and_dropout_only_in_training():
    vit = small_vit(depth=5, drop_path_rate=0.2, drop_rate=0.3, attn_drop_rate=0.1, proj_drop_rate=0.1)
    assert isinstance(vit.blocks[0].drop_path, nn.Identity)  # rate 0 at the first block
    assert [blk.drop_path.drop_prob for blk in vit.blocks[1:]] == pytest.approx([0.05, 0.1, 0.15, 0.2])
    x = torch.randn(4, 3, 32, 32)
    assert not torch.allclose(vit(x), vit(x))
    vit.eval()
    torch.testing.assert_close(vit(x), vit(x))


def test_init_like_timm():
    vit = VisionTransformer()  # vit_tiny-sized: enough weights for the statistics
    qkv = vit.blocks[0].attn.qkv
    assert abs(qkv.weight.std().item() - 0.02) < 0.002  # timm's trunc_normal_ cuts at +-2, not +-2 std
    assert torch.equal(qkv.bias, torch.zeros_like(qkv.bias))
    assert abs(vit.pos_embed.std().item() - 0.02) < 0.002 and vit.cls_token.abs().max() < 1e-4
    assert vit.no_weight_decay() == {"pos_embed", "cls_token"}


def test_loading_at_another_img_size_resamples_pos_embed():
    src = small_vit()
    dst = small_vit(img_size=48)
    dst.load_state_dict(src.state_dict())
    grid = src.pos_embed[:, 1:].reshape(1, 8, 8, 32).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(12, 12), mode="bicubic", antialias=True).permute(0, 2, 3, 1)
    torch.testing.assert_close(dst.pos_embed[:, 1:], expected.reshape(1, 144, 32))
    torch.testing.assert_close(dst.pos_embed[:, 0], src.pos_embed[:, 0])
    torch.testing.assert_close(dst.cls_token, src.cls_token)
    assert dst(torch.randn(1, 3, 48, 48)).shape == (1, 10)
    with pytest.raises(ValueError, match="non-square"):
        dst.load_state_dict(small_vit(img_size=(32, 48)).state_dict())


def test_entry_points_sizes():
    for name, (dim, depth, heads) in {"vit_nano": (128, 6, 4), "vit_tiny": (192, 12, 3),
                                      "vit_small": (384, 12, 6)}.items():
        vit = zoo.create_model(name)
        assert (vit.embed_dim, len(vit.blocks), vit.blocks[0].attn.num_heads, vit.patch_size) == \
               (dim, depth, heads, (4, 4))


def test_torch_compile_small_vit():
    vit = small_vit(depth=1).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(vit)(x), vit(x), atol=1e-5, rtol=1e-5)
