"""Compatibility name for ``zoo.models.interop``: ``from zoo.interop import vit_from_timm, vit_to_timm``."""

from .models.interop import vit_from_timm, vit_to_timm

__all__ = ["vit_from_timm", "vit_to_timm"]
