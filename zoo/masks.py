"""Compatibility name for ``zoo.layers.masks`` (``zoo.masks.causal_mask`` etc. keep working)."""

from .layers.masks import MaskSpec, causal_mask, padding_mask, sliding_window_mask, spec

__all__ = ["MaskSpec", "causal_mask", "padding_mask", "sliding_window_mask", "spec"]
