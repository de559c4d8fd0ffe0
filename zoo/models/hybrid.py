"""A hybrid CNN-attention classifier for small images: a convolutional stem in the manner of airbench
(Jordan 2024, https://arxiv.org/abs/2404.00498: a patch-whitening first conv computed from the training data,
then conv groups of conv-pool-BN-GELU-conv-BN-GELU) with a CBAM after each group (Woo et al. 2018,
https://arxiv.org/abs/1807.06521) takes a 32x32 image to a small grid (4x4 in ``hybrid_tiny``, where airbench's
last group ends), and pre-norm transformer blocks of ``zoo.MultiHeadAttention`` with a learned 2D relative
position bias (Swin, https://arxiv.org/abs/2103.14030) attend over the grid's tokens; a global average pool feeds
the head.

Prior art: CCT (Hassani et al. 2021, https://arxiv.org/abs/2104.05704) for a conv tokenizer instead of
patches on CIFAR; CoAtNet (Dai et al. 2021, https://arxiv.org/abs/2106.04803) and BoTNet
(Srinivas et al. 2021, https://arxiv.org/abs/2101.11605) for convolutions first, relative attention on the
small late grid. The convolutions give locality and translation equivariance, so the model needs no
absolute position embedding and learns from far fewer images than a ViT: the point is accuracy per second
of CPU training (see the entry points for sizes and BENCHMARKS.md for the measurements that chose them).

timm's model API: ``feature_info`` has one entry per conv group (``stem.3``, ...; (B, C, H, W) maps) and one per
transformer block; ``forward_intermediates``, ``prune_intermediate_layers`` (``features_only=True`` gives timm's
``FeatureGetterNet``), ``set_grad_checkpointing``, ``group_matcher``; torch.fx tracing and torch.export work.
"""

from __future__ import annotations

import torch
import torch.fx
from einops import rearrange
from timm.layers import calculate_drop_path_rates, to_2tuple, trunc_normal_
from timm.models import checkpoint_seq
from torch import nn

from ..layers.attention import MultiHeadAttention
from ..layers.cbam import CBAM
from ..layers.checks import check_int, check_rate
from ..layers.whitening import PatchWhitening
from .features import TOKEN_FEATURES, TokenFeatures
from .inputs import check_images
from .registry import register_model
from .vit import MAX_DEPTH, Block, LayerNormEps6

torch.fx.wrap("rearrange")  # einops cannot take an fx Proxy: the call becomes one node of the graph

__all__ = ["ConvGroup", "HybridNet", "hybrid_small", "hybrid_tiny"]


class ConvGroup(nn.Sequential):
    """airbench's conv group, halving the resolution: 3x3 conv, 2x2 max-pool, BN, GELU, 3x3 conv, BN, GELU,
    then a CBAM. (B, in_chs, H, W) -> (B, out_chs, H // 2, W // 2)."""

    def __init__(self, in_chs: int, out_chs: int, cbam_reduction: int = 16):
        super().__init__(
            nn.Conv2d(in_chs, out_chs, 3, padding=1, bias=False),
            nn.MaxPool2d(2),
            nn.BatchNorm2d(out_chs),
            nn.GELU(),
            nn.Conv2d(out_chs, out_chs, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_chs),
            nn.GELU(),
            CBAM(out_chs, reduction=cbam_reduction),
        )


class HybridNet(TokenFeatures, nn.Module):
    """Whitening conv stem with CBAM to a (H / 2^g, W / 2^g) grid for g conv groups, transformer blocks with
    2D relative position bias, avg pool.

    The stem: ``PatchWhitening`` (2x2 patches, right/bottom padded so the size is kept) and GELU, then one
    ``ConvGroup`` per width in ``(*stem_chs, embed_dim)``. Its (B, embed_dim, gh, gw) output is read row-major
    as gh * gw tokens for ``depth`` ``vit.Block``s (``attn_layer``, by default ``zoo.MultiHeadAttention`` with
    ``rel_pos_grid=(gh, gw)``), then LayerNorm, mean over tokens, head. Call ``stem[0].fit(images)`` (the
    training pipeline does) to compute the whitening filters from training images.

    Args:
        img_size: int or (h, w); each side a positive multiple of 2^g (g = len(stem_chs) + 1). Inputs must
            have exactly this size (the relative bias is built for that grid).
        num_classes: 0 -> ``forward`` returns pooled features (B, embed_dim).
        stem_chs: widths of the conv groups before the last (whose width is ``embed_dim``).
        drop_path_rate: stochastic depth, rising linearly from 0 at the first block to this at the last.
        backend: attention backend of every block ("auto", "sdpa", "math", "chunked"; "linear" has no
            relative bias and raises).
    """

    def __init__(self, img_size: int | tuple[int, int] = 32, in_chans: int = 3, num_classes: int = 10, *,
                 stem_chs: tuple[int, ...] = (64,), embed_dim: int = 128, depth: int = 2, num_heads: int = 4,
                 mlp_ratio: float = 2.0, qkv_bias: bool = True, drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, attn_layer=MultiHeadAttention, backend: str = "auto"):
        super().__init__()
        for name, value in (("in_chans", in_chans), ("embed_dim", embed_dim)):
            check_int(name, value)  # 0 would build a model without input channels or width
        check_int("depth", depth, minimum=0, maximum=MAX_DEPTH)  # 0: the conv network alone, its grid as tokens
        check_rate("drop_path_rate", drop_path_rate)
        self.img_size = to_2tuple(img_size)
        stride = 2 ** (len(stem_chs) + 1)
        if any(not isinstance(s, int) or s < stride or s % stride for s in self.img_size):
            raise ValueError(f"img_size must be a positive multiple of {stride} (the stem halves it "
                             f"{len(stem_chs) + 1} times to the attention grid), got {img_size}")
        self.grid_size = (self.img_size[0] // stride, self.img_size[1] // stride)
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        # 12 whitening filters (an RGB 2x2 patch's dimension) whatever in_chans is: the width after the stem's
        # first layer stays fixed, so timm can adapt pretrained weights to other in_chans
        whiten = PatchWhitening(in_chans, kernel_size=2, num_filters=12)
        widths = (whiten.out_chans, *stem_chs, embed_dim)
        self.stem = nn.Sequential(
            whiten, nn.ZeroPad2d((0, 1, 0, 1)), nn.GELU(),
            *[ConvGroup(w_in, w_out) for w_in, w_out in zip(widths[:-1], widths[1:], strict=True)])
        attn_kwargs = dict(rel_pos_grid=self.grid_size, backend=backend)
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_path=rate, attn_layer=attn_layer,
                  attn_kwargs=attn_kwargs)
            for rate in calculate_drop_path_rates(drop_path_rate, depth)])
        self.norm = LayerNormEps6(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.num_prefix_tokens = 0
        self.grad_checkpointing = False
        self.feature_info = [dict(module=f"stem.{self._STAGES_FROM + i}", num_chs=w, reduction=2 ** (i + 1))
                             for i, w in enumerate(widths[1:])]
        self.feature_info += [dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=stride) for i in range(depth)]
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
        like = next(self.parameters())  # the final norm may have been pruned away
        self.head = (nn.Linear(self.embed_dim, num_classes, device=like.device, dtype=like.dtype)
                     if num_classes else nn.Identity())

    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups for timm's layer-wise lr decay: the stem, then one group per block."""
        return dict(stem=r"^stem", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    _STAGES_FROM = 3  # stem = whitening, pad, GELU, then the conv groups

    @property
    def conv_stages(self) -> list[nn.Module]:
        """The conv groups of the stem (each a feature stage)."""
        return list(self.stem)[self._STAGES_FROM:]

    def keep_conv_stages(self, n: int) -> None:
        self.stem = self.stem[:self._STAGES_FROM + n]

    def forward_pre_stages(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, *img_size) -> whitened (B, 24, *img_size), the first conv group's input."""
        check_images(x, self.in_chans, self.img_size, self._weight_dtype)
        return self.stem[:self._STAGES_FROM](x)

    def forward_stem(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, *img_size) -> feature grid (B, embed_dim, gh, gw)."""
        check_images(x, self.in_chans, self.img_size, self._weight_dtype)
        return self.stem(x)

    @property
    def _weight_dtype(self) -> torch.dtype:
        """The dtype of the stem's weights (the final norm may be pruned to Identity for features_only)."""
        return next(self.stem.parameters()).dtype

    def forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Feature grid (B, embed_dim, gh, gw) -> tokens (B, gh * gw, embed_dim), row-major."""
        return rearrange(x, "b c gh gw -> b (gh gw) c")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, *img_size) -> tokens (B, gh * gw, embed_dim), row-major, after the final norm."""
        tokens = self.forward_tokens(self.forward_stem(x))
        tokens = checkpoint_seq(self.blocks, tokens) if self.grad_checkpointing else self.blocks(tokens)
        return self.norm(tokens)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, N, embed_dim) -> logits (B, num_classes), or pooled features (B, embed_dim)."""
        x = self.head_drop(x.mean(dim=1))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


@register_model(first_conv="stem.0", classifier="head", fixed_input_size=True, feature_cfg=TOKEN_FEATURES)
def hybrid_tiny(**kwargs) -> HybridNet:
    """Whitening stem, conv groups of width 64, 256 and 256 (airbench94's widths, each group with CBAM) to the 4x4
    grid, 2 blocks of width 256, 8 heads, MLP ratio 2: 3.0M parameters. Chosen for test accuracy after 10 and 60
    minutes of 2-core CPU training (BENCHMARKS.md)."""
    return HybridNet(**{**dict(stem_chs=(64, 256), embed_dim=256, depth=2, num_heads=8, mlp_ratio=2.0), **kwargs})


@register_model(first_conv="stem.0", classifier="head", fixed_input_size=True, feature_cfg=TOKEN_FEATURES)
def hybrid_small(**kwargs) -> HybridNet:
    """``hybrid_tiny`` wider and deeper: conv groups of width 96, 384 and 384 (each with CBAM) to the 4x4 grid,
    3 blocks of width 384, 12 heads, MLP ratio 2: 8.0M parameters."""
    return HybridNet(**{**dict(stem_chs=(96, 384), embed_dim=384, depth=3, num_heads=12, mlp_ratio=2.0), **kwargs})
