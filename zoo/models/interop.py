"""Weights between the zoo's ViT and timm's ``VisionTransformer``: ``vit_from_timm`` / ``vit_to_timm``
build the other library's model with the same architecture and copy the state_dict unchanged (the zoo ViT
uses timm's parameter names and its qkv layout), so both give the same logits. With another ``img_size``
the learned position embedding is resampled (bicubic, timm's ``resample_abs_pos_embed``). Architecture
features one side lacks raise ``ValueError`` naming them instead of being dropped silently."""

from __future__ import annotations

import torch
from timm.layers import DropPath, Mlp, PatchDropout, resample_abs_pos_embed, to_2tuple
from timm.layers.attention import Attention as TimmAttention
from timm.models.vision_transformer import Block as TimmBlock
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer
from torch import nn

from ..layers.attention import MultiHeadAttention
from .vit import VisionTransformer

__all__ = ["vit_from_timm", "vit_to_timm"]


def _is_vit_layer_norm(m: nn.Module, dim: int) -> bool:
    return (isinstance(m, nn.LayerNorm) and m.normalized_shape == (dim,) and m.eps == 1e-6
            and m.elementwise_affine and m.bias is not None)


def _timm_unsupported(vit: TimmVisionTransformer) -> list[str]:
    """Names of the features of a timm ViT that the zoo ViT does not have."""
    dim, pe = vit.embed_dim, vit.patch_embed
    found = []
    flags = [
        (vit.no_embed_class, "no_embed_class=True"),
        (pe.dynamic_img_pad, "dynamic_img_pad=True"),
        (vit.pos_embed is None, "pos_embed='none'"),
        (not isinstance(vit.norm_pre, nn.Identity), "pre_norm=True"),
        (vit.global_pool not in ("token", "avg"), f"global_pool={vit.global_pool!r}"),
        (vit.has_class_token and vit.global_pool == "avg", "class_token=True with global_pool='avg'"),
        (vit.pool_include_prefix, "pool_include_prefix=True"),
        (not isinstance(pe.norm, nn.Identity), "embed_norm_layer (a norm in the patch embedding)"),
        (pe.proj.bias is None, "a patch embedding without bias"),
    ]
    found += [name for flag, name in flags if flag]
    norm_before_pool = vit.global_pool == "token"
    if (_is_vit_layer_norm(vit.norm, dim) != norm_before_pool
            or _is_vit_layer_norm(vit.fc_norm, dim) == norm_before_pool):
        found.append(f"fc_norm / final_norm placement (norm={type(vit.norm).__name__}, "
                     f"fc_norm={type(vit.fc_norm).__name__}; the zoo normalises before 'token' pooling "
                     "and after 'avg' pooling, with LayerNorm eps 1e-6)")
    for blk in vit.blocks:
        found += _timm_block_unsupported(blk, dim)
    return list(dict.fromkeys(found))


def _timm_block_unsupported(blk: nn.Module, dim: int) -> list[str]:
    """Names of the features of one timm ViT block that the zoo's ``Block`` does not have."""
    if type(blk) is not TimmBlock:
        return [f"block_fn={type(blk).__name__}"]
    attn, mlp = blk.attn, blk.mlp
    flags = [
        (not isinstance(blk.ls1, nn.Identity), "init_values (LayerScale)"),
        (type(attn) is not TimmAttention, f"attn_layer={type(attn).__name__}"),
        (type(mlp) is not Mlp, f"mlp_layer={type(mlp).__name__}"),
        (not (_is_vit_layer_norm(blk.norm1, dim) and _is_vit_layer_norm(blk.norm2, dim)),
         f"norm_layer={type(blk.norm1).__name__} (the zoo uses LayerNorm eps 1e-6)"),
    ]
    if type(attn) is TimmAttention:
        flags += [
            (not isinstance(attn.q_norm, nn.Identity), "qk_norm=True"),
            (not isinstance(attn.norm, nn.Identity), "scale_attn_norm=True"),
            (getattr(attn, "gate", None) is not None, "gated attention"),
            (attn.attn_dim != dim, f"attn_head_dim={attn.head_dim}"),
            (attn.proj.bias is None, "proj_bias=False"),
        ]
    if type(mlp) is Mlp:
        act = mlp.act
        flags += [
            (not isinstance(mlp.norm, nn.Identity), "scale_mlp_norm=True"),
            (mlp.fc1.bias is None or mlp.fc2.bias is None, "proj_bias=False"),
            (type(act) is not nn.GELU or act.approximate != "none", f"act_layer={act!r}"),
        ]
    return [name for flag, name in flags if flag]


def _grid(img_size: tuple[int, int], patch_size: tuple[int, int]) -> tuple[int, int]:
    if img_size[0] % patch_size[0] or img_size[1] % patch_size[1]:
        raise ValueError(f"img_size {img_size} must be divisible by patch_size {patch_size}")
    return img_size[0] // patch_size[0], img_size[1] // patch_size[1]


def _block_config(blocks: nn.Sequential, attn_drop: float) -> dict:
    """depth, num_heads, mlp_ratio, qkv_bias and dropout rates read off a stack of timm-shaped blocks."""
    if not len(blocks):
        raise ValueError("a ViT with depth 0 (no blocks) is not supported")
    first, last = blocks[0], blocks[-1]
    dim, hidden = first.mlp.fc1.in_features, first.mlp.fc1.out_features
    if int(dim * (hidden / dim)) != hidden:
        raise ValueError(f"MLP width {hidden} is not int(embed_dim={dim} * mlp_ratio) for a float mlp_ratio")
    drop_path = getattr(last, "drop_path", getattr(last, "drop_path1", None))
    return dict(embed_dim=dim, depth=len(blocks), num_heads=first.attn.num_heads, mlp_ratio=hidden / dim,
                qkv_bias=first.attn.qkv.bias is not None, proj_drop_rate=first.attn.proj_drop.p,
                attn_drop_rate=attn_drop,
                drop_path_rate=drop_path.drop_prob if isinstance(drop_path, DropPath) else 0.0)


def _patch_drop_rate(vit: nn.Module) -> float:
    """The share of patch tokens a ViT (timm's or the zoo's) drops in training: its ``PatchDropout``'s."""
    return vit.patch_drop.prob if isinstance(vit.patch_drop, PatchDropout) else 0.0


def _copy(src: nn.Module, dst: nn.Module, src_grid: tuple[int, int], dst_grid: tuple[int, int],
          num_prefix_tokens: int, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    state_dict["pos_embed"] = resample_abs_pos_embed(state_dict["pos_embed"], list(dst_grid), list(src_grid),
                                                     num_prefix_tokens=num_prefix_tokens)
    dst.load_state_dict(state_dict)
    reference = next(src.parameters())
    return dst.to(device=reference.device, dtype=reference.dtype).train(src.training)


def vit_from_timm(timm_vit: TimmVisionTransformer, img_size: int | tuple[int, int] | None = None
                  ) -> VisionTransformer:
    """A zoo ViT with the architecture and weights of ``timm_vit`` (a plain
    ``timm.models.vision_transformer.VisionTransformer``) at ``img_size`` (default: timm's)."""
    if type(timm_vit) is not TimmVisionTransformer:
        raise ValueError("expected a timm.models.vision_transformer.VisionTransformer, "
                         f"got {type(timm_vit).__name__}")
    unsupported = _timm_unsupported(timm_vit)
    if unsupported:
        raise ValueError("the zoo ViT has no equivalent of these timm ViT features: "
                         + "; ".join(unsupported))
    pe = timm_vit.patch_embed
    img_size = to_2tuple(img_size) if img_size is not None else tuple(pe.img_size)
    config = _block_config(timm_vit.blocks, timm_vit.blocks[0].attn.attn_drop.p if timm_vit.blocks else 0.0)
    zoo_vit = VisionTransformer(img_size, tuple(pe.patch_size), pe.proj.in_channels, timm_vit.num_classes,
                                global_pool=timm_vit.global_pool, drop_rate=timm_vit.head_drop.p,
                                reg_tokens=timm_vit.num_reg_tokens, patch_drop_rate=_patch_drop_rate(timm_vit),
                                dynamic_img_size=timm_vit.dynamic_img_size, **config)
    return _copy(timm_vit, zoo_vit, tuple(pe.grid_size), _grid(img_size, tuple(pe.patch_size)),
                 timm_vit.num_prefix_tokens, timm_vit.state_dict())


def vit_to_timm(zoo_vit: VisionTransformer, img_size: int | tuple[int, int] | None = None
                ) -> TimmVisionTransformer:
    """A ``timm.models.vision_transformer.VisionTransformer`` with the architecture and weights of a zoo ViT
    at ``img_size`` (default: the zoo model's). A fixed sin-cos position embedding becomes timm's learned
    one with the same values (with ``dynamic_img_size``, timm resamples it at another grid where the zoo
    recomputes it); a relative position bias has no timm equivalent (ValueError)."""
    if not isinstance(zoo_vit, VisionTransformer):
        raise ValueError(f"expected a zoo VisionTransformer, got {type(zoo_vit).__name__}")
    attns = [blk.attn for blk in zoo_vit.blocks]
    if any(type(a) is not MultiHeadAttention for a in attns):
        raise ValueError("timm's ViT has only its own attention; this zoo ViT uses "
                         f"{sorted({type(a).__name__ for a in attns})}")
    if any(a.rel_pos_bias is not None for a in attns):
        raise ValueError("timm's VisionTransformer has no relative position bias (rel_pos_bias=True)")
    img_size = to_2tuple(img_size) if img_size is not None else zoo_vit.img_size
    config = _block_config(zoo_vit.blocks, attns[0].attn_drop if attns else 0.0)
    timm_vit = TimmVisionTransformer(
        img_size=img_size, patch_size=zoo_vit.patch_size, in_chans=zoo_vit.in_chans,
        num_classes=zoo_vit.num_classes, global_pool=zoo_vit.global_pool,
        class_token=zoo_vit.cls_token is not None, reg_tokens=zoo_vit.num_reg_tokens, drop_rate=zoo_vit.head_drop.p,
        patch_drop_rate=_patch_drop_rate(zoo_vit), dynamic_img_size=zoo_vit.dynamic_img_size, weight_init="skip",
        **config)
    state_dict = zoo_vit.state_dict()
    state_dict["pos_embed"] = zoo_vit.pos_embed.detach()  # a sin-cos table is a non-persistent buffer
    return _copy(zoo_vit, timm_vit, zoo_vit.grid_size, _grid(img_size, zoo_vit.patch_size),
                 zoo_vit.num_prefix_tokens, state_dict)
