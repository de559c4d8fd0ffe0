"""Test-time augmentation as airbench does it (https://github.com/KellerJordan/cifar10-airbench): level 0 is
the plain forward; level 1 averages the logits of the image and its mirror; level 2 also averages in the mirror
pair of the image translated by one pixel up-left and one down-right (reflect padding), weighted half and half.
Images (B, C, H, W) normalised; returns logits (B, num_classes), averaged in float32 (under bf16 autocast the
forward's logits are bf16, whose rounding would flip near ties)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

TTA_LEVELS = (0, 1, 2)
TTA_NAMES = {0: "none", 1: "mirror", 2: "mirror + one-pixel shifts"}
REPORTED_TTA = 2  # the level of every "with TTA" number the zoo reports: README, the model cards, eval.py --report


def _mirror(forward: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    return 0.5 * (forward(images).float() + forward(images.flip(-1)).float())


def tta_logits(forward: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, level: int) -> torch.Tensor:
    """Logits of ``forward`` under test-time augmentation ``level`` (0, 1 or 2)."""
    if level not in TTA_LEVELS:
        raise ValueError(f"tta level must be one of {TTA_LEVELS}, got {level!r}")
    if level == 0:
        return forward(images)
    logits = _mirror(forward, images)
    if level == 1:
        return logits
    h, w = images.shape[-2:]
    padded = F.pad(images, (1, 1, 1, 1), mode="reflect")
    shifted = [padded[..., :h, :w], padded[..., 2:, 2:]]
    return 0.5 * logits + 0.5 * torch.stack([_mirror(forward, x) for x in shifted]).mean(0)
