"""zoo: attention building blocks for vision, the models made of them, and tools that explain them.
Importing zoo registers every model in timm's registry as ``zoo_<name>``."""

from . import interop, masks
from .attention import BACKENDS, KVCache, MultiHeadAttention, get_backend, set_backend
from .cbam import CBAM, ChannelAttention, SpatialAttention, add_cbam
from .explain import attention_rollout, record_attention
from .models import create_model, list_models, model_info, register_model
from .runs import load_run

__all__ = [
    "BACKENDS", "KVCache", "MultiHeadAttention", "create_model", "get_backend", "interop", "list_models",
    "load_run", "masks", "model_info", "record_attention", "register_model", "set_backend",
    "attention_rollout", "CBAM", "ChannelAttention", "SpatialAttention", "add_cbam",
]
__version__ = "0.1.0"
