"""Input checks shared by every model's forward: a user's wrong image batch becomes a ValueError that names
what was expected and what was given, instead of an error from deep inside a conv. The check steps aside while
``torch.fx`` traces symbolically (``zoo.layers.checks.tracing``)."""

from __future__ import annotations

import torch

from ..layers.checks import check_dtype, tracing


def check_images(x, in_chans: int, img_size: tuple[int, int] | None = None, dtype: torch.dtype | None = None) -> None:
    """``x`` must be a floating (B, in_chans, H, W) tensor, with (H, W) == img_size when one is given and the
    model's ``dtype`` (float64 images into a float32 model) unless autocast casts them."""
    if tracing():
        return
    size = f"{img_size[0]}, {img_size[1]}" if img_size is not None else "H, W"
    expected = f"images of shape (B, C, H, W) = (B, {in_chans}, {size})"
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected {expected}, got {type(x).__name__}")
    if x.dim() != 4 or x.shape[1] != in_chans or (img_size is not None and tuple(x.shape[2:]) != img_size):
        raise ValueError(f"expected {expected}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"expected floating-point {expected} (normalised float32), got dtype {x.dtype}")
    if dtype is not None:
        check_dtype("x", x, dtype)
