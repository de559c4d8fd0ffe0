"""A hybrid CNN-attention classifier for small images: a convolutional stem with CBAM (Woo et al. 2018,
https://arxiv.org/abs/1807.06521) takes the image to a grid 4x smaller (32x32 -> 8x8), and pre-norm
transformer blocks of ``zoo.MultiHeadAttention`` with a learned 2D relative position bias (Swin,
https://arxiv.org/abs/2103.14030) attend over the grid's tokens; a global average pool feeds the head.

Prior art: CCT (Hassani et al. 2021, https://arxiv.org/abs/2104.05704) for a conv tokenizer instead of
patches on CIFAR; CoAtNet (Dai et al. 2021, https://arxiv.org/abs/2106.04803) and BoTNet
(Srinivas et al. 2021, https://arxiv.org/abs/2101.11605) for convolutions first, relative attention on the
small late grid. The convolutions give locality and translation equivariance, so the model needs no
absolute position embedding and learns from far fewer images than a ViT: the point is accuracy per FLOP
and per second of CPU training (see the entry points for sizes and measured throughput).
"""

from __future__ import annotations

import torch
from einops import rearrange
from timm.layers import ConvNormAct, calculate_drop_path_rates, to_2tuple, trunc_normal_
from torch import nn

from ..layers.attention import MultiHeadAttention
from ..layers.cbam import CBAM
from .inputs import check_images
from .registry import register_model
from .vit import Block, LayerNormEps6

__all__ = ["HybridNet", "hybrid_small", "hybrid_tiny"]


class HybridNet(nn.Module):
    """Conv stem with CBAM to a (H/4, W/4) grid, transformer blocks with 2D relative position bias, avg pool.

    The stem: 3x3 conv-BN-ReLU ``in_chans -> stem_chs[0]`` stride 2; 3x3 conv-BN-ReLU ``-> stem_chs[1]``,
    CBAM; 3x3 conv-BN-ReLU ``-> embed_dim`` stride 2, CBAM. Its (B, embed_dim, gh, gw) output is read
    row-major as gh * gw tokens for ``depth`` ``vit.Block``s (``attn_layer``, by default
    ``zoo.MultiHeadAttention`` with ``rel_pos_grid=(gh, gw)``), then LayerNorm, mean over tokens, head.

    Args:
        img_size: int or (h, w); each side must be a positive multiple of 4 (grid = img_size // 4).
            Inputs must have exactly this size (the relative bias is built for that grid).
        num_classes: 0 -> ``forward`` returns pooled features (B, embed_dim).
        stem_chs: widths of the first two stem convs.
        drop_path_rate: stochastic depth, rising linearly from 0 at the first block to this at the last.
        backend: attention backend of every block ("auto", "sdpa", "math", "chunked", "linear"; the
            linear one has no relative bias and raises).
    """

    def __init__(self, img_size: int | tuple[int, int] = 32, in_chans: int = 3, num_classes: int = 10, *,
                 stem_chs: tuple[int, int] = (32, 64), embed_dim: int = 128, depth: int = 3,
                 num_heads: int = 4, mlp_ratio: float = 2.0, qkv_bias: bool = True, drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, attn_layer=MultiHeadAttention, backend: str = "auto"):
        super().__init__()
        self.img_size = to_2tuple(img_size)
        if any(not isinstance(s, int) or s < 4 or s % 4 for s in self.img_size):
            raise ValueError(f"img_size must be a positive multiple of 4 (the stem downsamples by 4 to the "
                             f"attention grid), got {img_size}")
        self.grid_size = (self.img_size[0] // 4, self.img_size[1] // 4)
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_features = self.embed_dim = embed_dim
        self.stem = nn.Sequential(
            ConvNormAct(in_chans, stem_chs[0], 3, stride=2),
            ConvNormAct(stem_chs[0], stem_chs[1], 3),
            CBAM(stem_chs[1]),
            ConvNormAct(stem_chs[1], embed_dim, 3, stride=2),
            CBAM(embed_dim),
        )
        attn_kwargs = dict(rel_pos_grid=self.grid_size, backend=backend)
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_path=rate, attn_layer=attn_layer,
                  attn_kwargs=attn_kwargs)
            for rate in calculate_drop_path_rates(drop_path_rate, depth)])
        self.norm = LayerNormEps6(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        for m in self.modules():  # timm's transformer init for Linear layers; convs keep torch's
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """The relative position bias tables, as timm's Swin excludes them."""
        return {name for name, _ in self.named_parameters() if "relative_position_bias_table" in name}

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """New head with ``num_classes`` outputs (0: none). Pooling is always "avg"."""
        if global_pool not in (None, "avg"):
            raise ValueError(f"global_pool must be 'avg' (the only pooling here), got {global_pool!r}")
        self.num_classes = num_classes
        weight = self.norm.weight
        self.head = (nn.Linear(self.embed_dim, num_classes, device=weight.device, dtype=weight.dtype)
                     if num_classes else nn.Identity())

    def forward_stem(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, *img_size) -> feature grid (B, embed_dim, gh, gw)."""
        check_images(x, self.in_chans, self.img_size)
        return self.stem(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, *img_size) -> tokens (B, gh * gw, embed_dim), row-major, after the final norm."""
        tokens = rearrange(self.forward_stem(x), "b c gh gw -> b (gh gw) c")
        return self.norm(self.blocks(tokens))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, N, embed_dim) -> logits (B, num_classes), or pooled features (B, embed_dim)."""
        x = self.head_drop(x.mean(dim=1))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


@register_model(first_conv="stem.0.conv", classifier="head")
def hybrid_tiny(**kwargs) -> HybridNet:
    """Stem 32-64-128 channels to the 8x8 grid, 3 blocks of width 128, 4 heads, MLP ratio 2: 0.5M
    parameters, 0.08 GFLOPs per 32x32 image; ~230 training img/s on one CPU core (batch 128, fp32,
    AdamW), 3.5x timm's ViT of width 192, depth 6, patch 4 measured the same way."""
    return HybridNet(**{**dict(stem_chs=(32, 64), embed_dim=128, depth=3, num_heads=4, mlp_ratio=2.0),
                        **kwargs})


@register_model(first_conv="stem.0.conv", classifier="head")
def hybrid_small(**kwargs) -> HybridNet:
    """Stem 48-96-192 channels to the 8x8 grid, 4 blocks of width 192, 6 heads, MLP ratio 2: 1.4M
    parameters, 0.21 GFLOPs per 32x32 image; ~95 training img/s on one CPU core (batch 128, fp32, AdamW)."""
    return HybridNet(**{**dict(stem_chs=(48, 96), embed_dim=192, depth=4, num_heads=6, mlp_ratio=2.0),
                        **kwargs})
