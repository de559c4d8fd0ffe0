"""Compatibility name for ``zoo.layers.masks`` (``zoo.masks.causal_mask`` etc. keep working)."""

from .layers.masks import causal_mask, padding_mask, sliding_window_mask

__all__ = ["causal_mask", "padding_mask", "sliding_window_mask"]
