"""Vision Transformer (Dosovitskiy et al. 2020, https://arxiv.org/abs/2010.11929) built from
``zoo.MultiHeadAttention``, sized for CIFAR-10 (32x32 images, 4x4 patches).

The defaults are timm's plain ``VisionTransformer`` (class token, learned position embedding, pre-norm
blocks with LayerNorm eps 1e-6 and GELU, qkv bias, no dropout or drop path), with timm's parameter names
(``cls_token``, ``pos_embed``, ``patch_embed.proj``, ``blocks.i.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,
mlp.fc2}``, ``norm``, ``fc_norm``, ``head``), so weights move to and from timm by a plain state_dict copy
(``zoo.interop``). Options timm lacks: a fixed 2D sin-cos position embedding (MAE) and a learned 2D relative
position bias in every attention layer (Swin-style), local (neighbourhood) attention over the patch grid through
a ``zoo.masks.spec`` (``local_window``), and a selectable attention backend.

timm's model API holds as for its own ViT: ``feature_info`` (one entry per block), ``forward_intermediates``,
``prune_intermediate_layers`` (so ``features_only=True`` gives timm's ``FeatureGetterNet``),
``set_grad_checkpointing``, ``group_matcher``; torch.fx symbolic tracing and torch.export work.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.fx
from einops import rearrange
from timm.layers import (
    DropPath,
    Mlp,
    PatchDropout,
    calculate_drop_path_rates,
    resample_abs_pos_embed,
    to_2tuple,
    trunc_normal_,
)
from timm.models import checkpoint_seq
from torch import nn

from ..layers.attention import MultiHeadAttention
from ..layers.checks import check_grid, check_int, check_rate, tracing
from ..layers.masks import MaskSpec, spec
from ..layers.position import sincos_pos_embed_2d
from .features import TOKEN_FEATURES, TokenFeatures
from .inputs import check_images
from .registry import register_model

torch.fx.wrap("rearrange")  # einops cannot take an fx Proxy: the call becomes one node of the graph

LayerNormEps6 = partial(nn.LayerNorm, eps=1e-6)  # timm's ViT norm

__all__ = ["Block", "Mlp", "PatchEmbed", "VisionTransformer", "vit_local_tiny", "vit_nano", "vit_small", "vit_tiny"]


MAX_DEPTH = 1000  # blocks a ViT or hybrid may have: deeper ones (the deepest published ViTs have 48) are refused


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens: a ``patch_size``-strided conv ``proj``.
    (B, in_chans, H, W) with (H, W) == img_size -> (B, gh * gw, embed_dim), row-major over the grid.
    ``strict_img_size=False`` (timm's flag): any (H, W) divisible by patch_size."""

    def __init__(self, img_size: int | tuple[int, int] = 32, patch_size: int | tuple[int, int] = 4,
                 in_chans: int = 3, embed_dim: int = 192, strict_img_size: bool = True):
        super().__init__()
        self.img_size = check_grid("img_size", to_2tuple(img_size))
        self.patch_size = check_grid("patch_size", to_2tuple(patch_size))
        if any(s % p for s, p in zip(self.img_size, self.patch_size, strict=True)):
            raise ValueError(f"img_size {self.img_size} must be divisible by patch_size {self.patch_size}")
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.in_chans, self.strict_img_size = in_chans, strict_img_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_images(x, self.in_chans, self.img_size if self.strict_img_size else None, self.proj.weight.dtype)
        if not self.strict_img_size and not tracing() and any(
                s % p for s, p in zip(x.shape[2:], self.patch_size, strict=True)):
            raise ValueError(f"image size {tuple(x.shape[2:])} must be divisible by patch_size {self.patch_size}")
        return rearrange(self.proj(x), "b c gh gw -> b (gh gw) c")


class Block(nn.Module):
    """Pre-norm transformer block: x + drop_path(attn(norm1(x))), then x + drop_path(mlp(norm2(x))).
    Tokens (B, N, dim) -> (B, N, dim).

    Args:
        attn_layer: the attention class, called as ``attn_layer(dim, num_heads, qkv_bias=..., attn_drop=...,
            proj_drop=..., **attn_kwargs)``; ``zoo.MultiHeadAttention`` by default.
        attn_kwargs: extra keyword arguments for it, e.g. ``rel_pos_grid``, ``num_prefix_tokens``,
            ``backend``.
        attn_mask: a ``zoo.masks.spec`` passed as ``mask=`` at every call (local attention), or None.
        drop_path: stochastic depth rate of both residual branches.
        proj_drop, attn_drop: dropout after the attention / MLP projections and on the attention weights.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 drop_path: float = 0.0, proj_drop: float = 0.0, attn_drop: float = 0.0,
                 norm_layer=LayerNormEps6, act_layer=nn.GELU,
                 attn_layer=MultiHeadAttention, attn_kwargs: dict | None = None, attn_mask: MaskSpec | None = None):
        super().__init__()
        self.attn_call = {} if attn_mask is None else {"mask": attn_mask}  # constant keyword arguments
        self.norm1 = norm_layer(dim)
        self.attn = attn_layer(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop,
                               **(attn_kwargs or {}))
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), **self.attn_call))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class VisionTransformer(TokenFeatures, nn.Module):
    """ViT classifier: patch embedding, [class token], position embedding, pre-norm blocks, pooling, head.

    Args:
        img_size, patch_size: int or (h, w); img_size must be divisible by patch_size. Inputs must have
            exactly img_size unless ``dynamic_img_size``. A learned ``pos_embed`` saved at another (square) grid
            is resampled (bicubic, timm's ``resample_abs_pos_embed``) when a state_dict is loaded.
        dynamic_img_size: as timm's flag: inputs of any size divisible by patch_size, the position embedding
            resampled to their grid at each call (a learned one bicubic, sin-cos recomputed). Not with
            ``rel_pos_bias`` or ``local_window``, which are built for one grid.
        num_classes: 0 -> ``forward`` returns pooled features (B, embed_dim).
        global_pool: "token" (class token, final ``norm`` before pooling) or "avg" (no class token, mean over
            patch tokens, then ``fc_norm``), as timm places the final norm.
        pos_embed: "learn" (trunc-normal initialised parameter) or "sincos" (fixed 2D sin-cos buffer, zero
            for the class token).
        rel_pos_bias: a learned 2D relative position bias over the patch grid in every attention layer.
        drop_rate: dropout before the head. proj_drop_rate / attn_drop_rate: dropout in every block.
        drop_path_rate: stochastic depth, rising linearly from 0 at the first block to this at the last.
        patch_drop_rate: in training only, each image keeps a random ``1 - patch_drop_rate`` share of its patch
            tokens after the position embedding (timm's ``PatchDropout``; FLIP, Li et al. 2023,
            https://arxiv.org/abs/2212.00794): the blocks see fewer tokens, so a step costs less, and evaluation
            sees them all. Not with ``rel_pos_bias`` or ``local_window``, which need the whole grid.
        backend: attention backend of every block ("auto", "sdpa", "math", "chunked", "linear", "flex").
        reg_tokens: register tokens (Darcet et al. 2024, https://arxiv.org/abs/2309.16588) after the class
            token, with position embeddings as timm's ``reg_tokens`` (``num_prefix_tokens`` counts them).
        local_window: local attention (neighbourhood attention, Hassani et al. 2022,
            https://arxiv.org/abs/2204.07143): each patch token attends only the patches within this many grid
            rows and columns, ``zoo.masks.spec(window=local_window, grid=grid_size)``, so "auto" runs the banded
            path (flex on CUDA) where the grid is large; needs ``global_pool="avg"`` (no class token).
    """

    def __init__(self, img_size: int | tuple[int, int] = 32, patch_size: int | tuple[int, int] = 4,
                 in_chans: int = 3, num_classes: int = 10, *, global_pool: str = "token",
                 embed_dim: int = 192, depth: int = 12, num_heads: int = 3, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, pos_embed: str = "learn", rel_pos_bias: bool = False,
                 drop_rate: float = 0.0, proj_drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, backend: str = "auto", local_window: int | None = None,
                 reg_tokens: int = 0, patch_drop_rate: float = 0.0, dynamic_img_size: bool = False):
        super().__init__()
        for name, value in (("in_chans", in_chans), ("embed_dim", embed_dim)):
            check_int(name, value)  # 0 would build a model without input channels
        check_int("depth", depth, maximum=MAX_DEPTH)  # 0: no blocks; above: refused before a block is built
        check_rate("drop_path_rate", drop_path_rate)  # timm's DropPath takes 2.0 and divides by -1
        if local_window is not None and global_pool != "avg":
            raise ValueError(f"local_window needs global_pool='avg' (a class token would attend globally), "
                             f"got global_pool={global_pool!r}")
        if global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
        if isinstance(reg_tokens, bool) or not isinstance(reg_tokens, int) or reg_tokens < 0:
            raise ValueError(f"reg_tokens must be an int >= 0, got {reg_tokens!r}")
        if reg_tokens and local_window is not None:
            raise ValueError("local_window attends over the patch grid alone: it takes no reg_tokens")
        if pos_embed not in ("learn", "sincos"):
            raise ValueError(f"pos_embed must be 'learn' or 'sincos', got {pos_embed!r}")
        if isinstance(patch_drop_rate, bool) or not isinstance(patch_drop_rate, (int, float)) \
                or not 0 <= patch_drop_rate < 1:
            raise ValueError(f"patch_drop_rate must be a number in [0, 1), got {patch_drop_rate!r}")
        if patch_drop_rate and (rel_pos_bias or local_window is not None):
            raise ValueError("patch_drop_rate drops tokens from the patch grid, which rel_pos_bias and local_window "
                             "need whole: use one or the other")
        if dynamic_img_size and (rel_pos_bias or local_window is not None):
            raise ValueError("dynamic_img_size changes the patch grid, for which rel_pos_bias and local_window are "
                             "built: use one or the other")
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_reg_tokens = reg_tokens
        self.num_prefix_tokens = (1 if global_pool == "token" else 0) + reg_tokens
        self.dynamic_img_size = bool(dynamic_img_size)
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, strict_img_size=not dynamic_img_size)
        self.img_size, self.patch_size = self.patch_embed.img_size, self.patch_embed.patch_size
        self.grid_size, self.in_chans = self.patch_embed.grid_size, in_chans

        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if global_pool == "token" else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        num_tokens = self.num_prefix_tokens + self.patch_embed.num_patches
        if pos_embed == "learn":
            self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim))
        else:
            table = sincos_pos_embed_2d(embed_dim, self.grid_size)  # (gh * gw, C); zero for the class token
            table = nn.functional.pad(table, (0, 0, self.num_prefix_tokens, 0))
            self.register_buffer("pos_embed", table[None], persistent=False)

        attn_mask = None if local_window is None else spec(window=local_window, grid=self.grid_size)
        self.local_window = local_window
        self.patch_drop = (PatchDropout(patch_drop_rate, num_prefix_tokens=self.num_prefix_tokens)
                           if patch_drop_rate else nn.Identity())
        attn_kwargs = dict(backend=backend)
        if rel_pos_bias:
            attn_kwargs.update(rel_pos_grid=self.grid_size, num_prefix_tokens=self.num_prefix_tokens)
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_path=rate, proj_drop=proj_drop_rate,
                  attn_drop=attn_drop_rate, attn_kwargs=attn_kwargs, attn_mask=attn_mask)
            for rate in calculate_drop_path_rates(drop_path_rate, depth)])
        self.norm = LayerNormEps6(embed_dim) if global_pool == "token" else nn.Identity()
        self.fc_norm = LayerNormEps6(embed_dim) if global_pool == "avg" else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.grad_checkpointing = False
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=max(self.patch_size))
                             for i in range(depth)]
        self._init_weights()

    def _init_weights(self) -> None:
        """timm's default ViT init: trunc-normal(0.02) Linear weights and pos_embed, zero biases,
        class token N(0, 1e-6); conv, LayerNorm and relative-bias tables keep their own init."""
        if isinstance(self.pos_embed, nn.Parameter):
            trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if self.reg_token is not None:
            nn.init.normal_(self.reg_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "pos_embed"
        if isinstance(self.pos_embed, nn.Parameter) and key in state_dict:
            saved = state_dict[key]
            if saved.shape != self.pos_embed.shape and saved.dim() == 3 and saved.shape[-1] == self.embed_dim:
                side = math.isqrt(saved.shape[1] - self.num_prefix_tokens)
                if side * side != saved.shape[1] - self.num_prefix_tokens:
                    raise ValueError(f"cannot resample a saved pos_embed of {saved.shape[1]} tokens "
                                     f"({self.num_prefix_tokens} prefix + a non-square grid) to grid "
                                     f"{self.grid_size}")
                state_dict[key] = resample_abs_pos_embed(saved, list(self.grid_size), [side, side],
                                                         num_prefix_tokens=self.num_prefix_tokens)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"} | ({"reg_token"} if self.reg_token is not None else set())

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """New head with ``num_classes`` outputs (0: none). ``global_pool`` "token" needs the class token;
        the final norm keeps its place (before or after pooling)."""
        if global_pool is not None:
            if global_pool not in ("token", "avg"):
                raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
            if global_pool == "token" and self.cls_token is None:
                raise ValueError("global_pool='token' needs a class token; this model was built with 'avg'")
            self.global_pool = global_pool
        self.num_classes = num_classes
        weight = self.patch_embed.proj.weight
        self.head = (nn.Linear(self.embed_dim, num_classes, device=weight.device, dtype=weight.dtype)
                     if num_classes > 0 else nn.Identity())

    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups for timm's layer-wise lr decay: the embedding, then one group per block."""
        return dict(stem=r"^cls_token|reg_token|pos_embed|patch_embed",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    def forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> tokens (B, num_prefix_tokens + gh * gw, embed_dim) entering the blocks (in
        training with ``patch_drop_rate``, fewer patch tokens)."""
        pos_embed = self.pos_embed
        if self.dynamic_img_size and not tracing():  # fx traces the model's own grid
            pos_embed = self.pos_embed_at((x.shape[-2] // self.patch_size[0], x.shape[-1] // self.patch_size[1]))
        x = self.patch_embed(x)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        return self.patch_drop(torch.cat([*prefix, x], dim=1) + pos_embed)  # timm's order: class, registers

    def pos_embed_at(self, grid: tuple[int, int]) -> torch.Tensor:
        """The position embedding (1, num_prefix_tokens + gh * gw, embed_dim) of a patch grid: ``pos_embed`` at
        the model's own grid; at another (``dynamic_img_size``) a learned table resampled as timm does, a sin-cos
        table computed for it."""
        if grid == tuple(self.grid_size):
            return self.pos_embed
        if isinstance(self.pos_embed, nn.Parameter):
            return resample_abs_pos_embed(self.pos_embed, list(grid), list(self.grid_size),
                                          num_prefix_tokens=self.num_prefix_tokens)
        table = sincos_pos_embed_2d(self.embed_dim, grid).to(self.pos_embed)
        return nn.functional.pad(table, (0, 0, self.num_prefix_tokens, 0))[None]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> tokens (B, num_prefix_tokens + gh * gw, embed_dim), after the final norm."""
        x = self.forward_tokens(x)
        x = checkpoint_seq(self.blocks, x) if self.grad_checkpointing else self.blocks(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, N, embed_dim) -> logits (B, num_classes), or pooled features (B, embed_dim)."""
        x = x[:, 0] if self.global_pool == "token" else x[:, self.num_prefix_tokens:].mean(dim=1)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


@register_model(first_conv="patch_embed.proj", classifier="head", fixed_input_size=True, feature_cfg=TOKEN_FEATURES)
def vit_nano(**kwargs) -> VisionTransformer:
    """ViT-Nano/4: width 128, depth 6, 4 heads, 4x4 patches (~1.2M parameters)."""
    return VisionTransformer(**{**dict(patch_size=4, embed_dim=128, depth=6, num_heads=4), **kwargs})


@register_model(first_conv="patch_embed.proj", classifier="head", fixed_input_size=True, feature_cfg=TOKEN_FEATURES)
def vit_tiny(**kwargs) -> VisionTransformer:
    """ViT-Tiny/4: width 192, depth 12, 3 heads, 4x4 patches (~5.4M parameters)."""
    return VisionTransformer(**{**dict(patch_size=4, embed_dim=192, depth=12, num_heads=3), **kwargs})


@register_model(first_conv="patch_embed.proj", classifier="head", fixed_input_size=True, feature_cfg=TOKEN_FEATURES)
def vit_small(**kwargs) -> VisionTransformer:
    """ViT-Small/4: width 384, depth 12, 6 heads, 4x4 patches (~21M parameters)."""
    return VisionTransformer(**{**dict(patch_size=4, embed_dim=384, depth=12, num_heads=6), **kwargs})


@register_model(first_conv="patch_embed.proj", classifier="head", fixed_input_size=True, feature_cfg=TOKEN_FEATURES)
def vit_local_tiny(**kwargs) -> VisionTransformer:
    """ViT-Tiny/4 with local attention: vit_tiny's width 192, depth 12, 3 heads and 4x4 patches, mean-pooled
    (no class token), each patch attending the 7x7 patches around it (``local_window=3``): ~5.4M parameters,
    attention linear in the number of patches (64x64 or 96x96 images: 256-576 tokens)."""
    defaults = dict(patch_size=4, embed_dim=192, depth=12, num_heads=3, global_pool="avg", local_window=3)
    return VisionTransformer(**{**defaults, **kwargs})
