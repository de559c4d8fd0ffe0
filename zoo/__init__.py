"""zoo: attention building blocks for vision, the models made of them, and tools that train and explain them.

The package is layered; arrows run downward only::

    train.py / eval.py (front ends)
      -> zoo.train                   training on Lightning Fabric: recipes, the loop, runs
      -> zoo.explain, zoo.bench      explaining trained models; timing and memory
      -> zoo.data, zoo.runtime       the images (read, cached, augmented); the machine (device, processes)
      -> zoo.models                  model families, registry (also timm's), checkpoints, interop
      -> zoo.layers                  attention, masks, position, CBAM: blocks for any model

(zoo.train and zoo.explain import neither the other.)

``import zoo`` loads torch, einops and timm only, and registers every model in timm's registry as
``zoo_<name>``; the explaining names below (``record_attention``, ``attention_rollout``) are loaded on first
use, and training (Lightning, torchmetrics) and figures (matplotlib) only when asked for."""

from importlib import import_module

from . import interop, masks
from .layers import (
    BACKENDS,
    CBAM,
    ChannelAttention,
    KVCache,
    MultiHeadAttention,
    SpatialAttention,
    add_cbam,
    attention_backend,
    get_backend,
    set_backend,
)
from .models import create_model, list_models, load_run, model_info, register_model

_LAZY = {"record_attention": "zoo.explain", "attention_rollout": "zoo.explain"}

__all__ = [
    "BACKENDS", "CBAM", "ChannelAttention", "KVCache", "MultiHeadAttention", "SpatialAttention", "add_cbam",
    "attention_backend", "attention_rollout", "create_model", "get_backend", "interop", "list_models",
    "load_run", "masks", "model_info", "record_attention", "register_model", "set_backend",
]
__version__ = "0.2.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
