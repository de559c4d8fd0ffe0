"""Model families; importing this package registers every entry point (zoo's registry and timm's)."""

from . import hybrid, resnet, vit  # noqa: F401  (register the hybrid_*, resnet*, vit_* entry points)
from .registry import create_model, list_models, model_info, register_model

__all__ = ["create_model", "list_models", "model_info", "register_model"]
