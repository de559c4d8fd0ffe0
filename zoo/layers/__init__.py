"""Building blocks, importable into any model: multi-head attention with its backends and masks
(``attention``, ``backends``, ``masks`` with the ``spec`` every backend takes, ``flex`` for FlexAttention),
position information (``position``), CBAM channel + spatial attention (``cbam``) and the argument checks they
share (``checks``). Imports torch and einops (and timm / torchvision lazily inside ``add_cbam``); nothing here
imports the rest of the zoo."""

from . import masks
from .attention import BACKENDS, KVCache, MultiHeadAttention, attention_backend, get_backend, set_backend
from .cbam import CBAM, ChannelAttention, SpatialAttention, add_cbam
from .position import RelativePositionBias2D, sincos_pos_embed_2d

__all__ = [
    "BACKENDS", "CBAM", "ChannelAttention", "KVCache", "MultiHeadAttention", "RelativePositionBias2D",
    "SpatialAttention", "add_cbam", "attention_backend", "get_backend", "masks", "set_backend",
    "sincos_pos_embed_2d",
]
