"""Model families; importing this package registers every entry point (zoo's registry and timm's)."""

from . import resnet, vit  # noqa: F401  (register the resnet*, vit_* entry points)
from .registry import create_model, list_models, model_info, register_model

__all__ = ["create_model", "list_models", "model_info", "register_model"]
