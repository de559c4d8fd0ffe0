"""Model families built from ``zoo.layers`` (``vit``, ``hybrid``, ``resnet``), the registry that names them
(``registry``: ``create_model``, ``list_models``, ``model_info``, and timm's ``zoo_<name>`` entries; a model's
arguments checked against its constructor in ``arguments``), reading
trained weights back (``checkpoints``), moving ViT weights to and from timm (``interop``) and compiling a model's
repeated blocks (``regions``). Imports torch,
einops, timm and ``zoo.layers`` only; importing it registers every entry point."""

from . import hybrid, resnet, vit  # noqa: F401  (register the hybrid_*, resnet*, vit_* entry points)
from .checkpoints import load_pretrained, load_run, load_shipped
from .regions import compile_regions
from .registry import (
    check_model_args,
    check_model_fits,
    create_model,
    list_models,
    model_card,
    model_info,
    models_table,
    register_model,
    shipped_models,
)

__all__ = ["check_model_args", "check_model_fits", "compile_regions", "create_model", "list_models",
           "load_pretrained", "load_run", "load_shipped", "model_card", "model_info", "models_table",
           "register_model", "shipped_models"]
