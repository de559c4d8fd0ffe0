"""How faithful a heatmap is: the deletion test (blank the patches it ranks most important first; a faithful
one makes accuracy drop fastest, Petsiuk et al. 2018, https://arxiv.org/abs/1806.07421). Images are normalised,
so a blanked patch is 0 (the dataset mean)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .rollout import explain


def _blank(images: torch.Tensor, order: torch.Tensor, count: int, grid: int) -> torch.Tensor:
    """Zero the first ``count`` patches of ``order`` (B, grid*grid) in each image (B, C, H, W)."""
    b, _, h, w = images.shape
    keep = torch.ones(b, grid * grid, device=images.device)
    keep.scatter_(1, order[:, :count], 0.0)
    keep = keep.reshape(b, 1, grid, grid).repeat_interleave(h // grid, 2).repeat_interleave(w // grid, 3)
    return images * keep.to(images.dtype)


@torch.no_grad()
def deletion_curve(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, heatmap: torch.Tensor,
                   fractions: Sequence[float], *, grid: int = 8, batch_size: int = 128) -> list[float]:
    """Top-1 accuracy after blanking (to 0, the mean of normalised images) the ``fraction`` of patches of a
    ``grid`` x ``grid`` patch grid that ``heatmap`` (B, gh, gw; resized to the grid by adaptive average
    pooling) ranks highest, for each fraction. images: (B, C, H, W) normalised, H, W divisible by ``grid``."""
    if images.dim() != 4 or images.shape[-1] % grid or images.shape[-2] % grid:
        raise ValueError(f"images must be (B, C, H, W) with H, W divisible by grid={grid}, "
                         f"got {tuple(images.shape)}")
    if heatmap.dim() != 3 or heatmap.shape[0] != images.shape[0]:
        raise ValueError(f"heatmap must be (B={images.shape[0]}, gh, gw), got {tuple(heatmap.shape)}")
    device = next(model.parameters()).device
    scores = F.adaptive_avg_pool2d(heatmap.float()[:, None], grid).flatten(1)
    order = scores.argsort(dim=1, descending=True, stable=True)
    accuracies = []
    for fraction in fractions:
        count = round(fraction * grid * grid)
        correct = 0
        for start in range(0, len(images), batch_size):
            part = slice(start, start + batch_size)
            blanked = _blank(images[part].to(device), order[part].to(device), count, grid)
            correct += (model(blanked).argmax(dim=-1) == labels[part].to(device)).sum().item()
        accuracies.append(correct / len(images))
    return accuracies


def curve_auc(fractions: Sequence[float], accuracies: Sequence[float]) -> float:
    """Area under a deletion curve, trapezoid rule over the fraction axis."""
    return sum((f1 - f0) * (a0 + a1) / 2 for f0, f1, a0, a1 in
               zip(fractions, fractions[1:], accuracies, accuracies[1:], strict=False))


@torch.no_grad()
def deletion_test(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, grid: int = 8,
                  fractions: Sequence[float] = tuple(i / 10 for i in range(10)), seed: int = 0,
                  batch_size: int = 128) -> dict:
    """Deletion test of the model's own explanation against a random ranking and against the last layer's
    raw attention (heads averaged). Attention models are explained by their rollout, CNNs with CBAM by the
    last spatial gate, anything else gets only the random ranking.
    images: (B, C, H, W) normalised; labels: (B,).

    Returns {"fractions", "num_images", "explanation", "curves": {method: [top-1 per fraction]},
    "auc": {method: area}}; methods are "random" plus "rollout" and "attention", or "cbam". Lower AUC = more
    faithful."""
    model.eval()
    device = next(model.parameters()).device
    heatmaps = {}
    explained = (explain(model, images[i:i + batch_size].to(device)) for i in range(0, len(images), batch_size))
    # each batch's heatmaps alone: its recording (every layer's (B, H, N, N) maps) is dropped at once
    parts = [{method: getattr(e, method) for method in ("rollout", "attention", "cbam")} for e in explained]
    for method in ("rollout", "attention", "cbam"):
        found = [p[method] for p in parts]
        if method == "cbam" and "rollout" in heatmaps:
            continue  # the hybrid is explained by its rollout; its gates feed the figures, not this test
        if all(h is not None for h in found):
            heatmaps[method] = torch.cat(found)
    generator = torch.Generator().manual_seed(seed)
    heatmaps["random"] = torch.rand(len(images), grid, grid, generator=generator)
    curves = {name: deletion_curve(model, images, labels, h, fractions, grid=grid, batch_size=batch_size)
              for name, h in heatmaps.items()}
    fractions = [float(f) for f in fractions]
    explanation = next((m for m in ("rollout", "cbam") if m in heatmaps), None)
    return {"fractions": fractions, "num_images": len(images), "explanation": explanation, "curves": curves,
            "auc": {name: curve_auc(fractions, c) for name, c in curves.items()}}
