"""Explaining what the models look at: recording attention weights and CBAM spatial gates, attention rollout
(Abnar & Zuidema 2020, https://arxiv.org/abs/2005.00928), patch heatmaps, and a deletion test of how faithful
a heatmap is (blank the patches it ranks most important first; a faithful one makes accuracy drop fastest,
Petsiuk et al. 2018, https://arxiv.org/abs/1806.07421).

Conventions: attention maps are (B, H, N, N) softmax weights, rollouts (B, N, N), heatmaps (B, gh, gw)
over the patch grid (larger = more important). Images given to the deletion test are normalised, so a blanked
patch is 0 (the dataset mean).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .attention import MultiHeadAttention

HEAD_FUSIONS = ("mean", "max", "min")
POOLINGS = ("token", "avg")


@dataclass
class AttentionRecording:
    """What one ``record_attention`` block saw, in forward order: ``maps`` (B, H, N, M) attention weights, one
    per MultiHeadAttention call; ``cbam`` (B, 1, H, W) spatial gates after the sigmoid, one per CBAM call."""

    maps: list[torch.Tensor] = field(default_factory=list)
    cbam: list[torch.Tensor] = field(default_factory=list)

    def clear(self) -> None:
        self.maps.clear()
        self.cbam.clear()


def _is_spatial_gate(module: nn.Module) -> bool:
    """zoo.cbam.SpatialAttention (and anything else that offers the same ``gate_hook`` attribute)."""
    return hasattr(module, "gate_hook")


@contextmanager
def record_attention(model: nn.Module, *, to_cpu: bool = True):
    """Record every attention map and CBAM spatial gate ``model`` computes inside the block::

        with zoo.record_attention(model) as rec:
            model(images)
        rec.maps  # list of (B, H, N, N); rec.cbam: list of (B, 1, H, W)

    Works whatever backend the attention modules run: while recording each one has a ``weights_hook`` set,
    which makes it compute its weights (with the math path where the backend is a fused kernel). Tensors are
    detached (and moved to the CPU with ``to_cpu``). The previous hooks are restored on exit, also on error.
    """
    rec = AttentionRecording()

    def keep(store: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
        def hook(t: torch.Tensor) -> None:
            t = t.detach()
            store.append(t.cpu() if to_cpu else t)
        return hook

    attn = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    gates = [m for m in model.modules() if _is_spatial_gate(m)]
    saved = [(m, "weights_hook", m.weights_hook) for m in attn]
    saved += [(m, "gate_hook", m.gate_hook) for m in gates]
    try:
        for m in attn:
            m.weights_hook = keep(rec.maps)
        for m in gates:
            m.gate_hook = keep(rec.cbam)
        yield rec
    finally:
        for m, name, old in saved:
            setattr(m, name, old)


def _check_maps(maps: Sequence[torch.Tensor]) -> None:
    if isinstance(maps, torch.Tensor) or not isinstance(maps, Sequence) or len(maps) == 0:
        length = f" of length {len(maps)}" if isinstance(maps, Sequence) else ""
        raise ValueError(f"maps must be a non-empty list of (B, H, N, N) attention weights, "
                         f"got {type(maps).__name__}{length}")
    first = maps[0]
    for i, a in enumerate(maps):
        if not isinstance(a, torch.Tensor) or a.dim() != 4 or a.shape[-1] != a.shape[-2]:
            shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            raise ValueError(f"maps[{i}] must be (B, H, N, N) self-attention weights, got {shape}")
        if a.shape[0] != first.shape[0] or a.shape[-1] != first.shape[-1]:
            raise ValueError(f"every map must share B and N; maps[0] is {tuple(first.shape)}, "
                             f"maps[{i}] is {tuple(a.shape)}")


def fuse_heads(weights: torch.Tensor, head_fusion: str = "mean") -> torch.Tensor:
    """(B, H, N, M) -> (B, N, M) by the mean / max / min over heads."""
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")
    if head_fusion == "mean":
        return weights.mean(dim=1)
    return weights.amax(dim=1) if head_fusion == "max" else weights.amin(dim=1)


def _discard_lowest(fused: torch.Tensor, discard_ratio: float, num_prefix_tokens: int) -> torch.Tensor:
    """Zero the ``discard_ratio`` smallest weights of each (N, N) map, among the non-prefix columns only."""
    b, n, _ = fused.shape
    candidates = fused[:, :, num_prefix_tokens:].reshape(b, -1)
    k = int(discard_ratio * candidates.shape[1])
    if k == 0:
        return fused
    lowest = candidates.topk(k, dim=1, largest=False).indices
    kept = torch.ones_like(candidates).scatter_(1, lowest, 0.0).reshape(b, n, n - num_prefix_tokens)
    return torch.cat([fused[:, :, :num_prefix_tokens], fused[:, :, num_prefix_tokens:] * kept], dim=2)


def attention_rollout(maps: Sequence[torch.Tensor], head_fusion: str = "mean", discard_ratio: float = 0.0,
                      num_prefix_tokens: int = 1) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020): how much each output token draws on each input token through
    all layers, counting the residual path.

    Per layer: fuse heads (``head_fusion``), optionally zero the lowest ``discard_ratio`` of the fused weights
    (never in the first ``num_prefix_tokens`` columns), A' = rownorm(0.5 * A + 0.5 * I). Then
    R = A_L' @ ... @ A_1'. maps: list of (B, H, N, N) in forward order.
    Returns (B, N, N) float32; rows sum to 1.
    """
    _check_maps(maps)
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    n = maps[0].shape[-1]
    if not 0 <= num_prefix_tokens < n:
        raise ValueError(f"num_prefix_tokens must be in [0, N={n}), got {num_prefix_tokens}")
    eye = torch.eye(n, device=maps[0].device)
    rollout = eye.expand(maps[0].shape[0], n, n)
    for weights in maps:
        fused = _discard_lowest(fuse_heads(weights.float(), head_fusion), discard_ratio, num_prefix_tokens)
        layer = 0.5 * fused + 0.5 * eye
        layer = layer / layer.sum(dim=-1, keepdim=True)
        rollout = layer @ rollout
    return rollout


def rollout_heatmap(rollout: torch.Tensor, grid_size: tuple[int, int], num_prefix_tokens: int,
                    pooling: str = "token") -> torch.Tensor:
    """Patch heatmap (B, gh, gw) from a (B, N, N) rollout (or one layer's head-fused weights):
    ``pooling="token"`` takes the class-token row over the patch columns (class-token models);
    ``"avg"`` the mean over the patch rows (models that average-pool the patch tokens)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    gh, gw = grid_size
    if rollout.dim() != 3 or rollout.shape[1:] != (num_prefix_tokens + gh * gw,) * 2:
        raise ValueError(f"rollout must be (B, N, N) with N = num_prefix_tokens + gh * gw = "
                         f"{num_prefix_tokens} + {gh}*{gw}, got {tuple(rollout.shape)}")
    if pooling == "token":
        if num_prefix_tokens < 1:
            raise ValueError("pooling='token' needs a class token (num_prefix_tokens >= 1); "
                             "use pooling='avg'")
        scores = rollout[:, 0, num_prefix_tokens:]
    else:
        scores = rollout[:, num_prefix_tokens:, num_prefix_tokens:].mean(dim=1)
    return scores.reshape(-1, gh, gw)


@dataclass
class Explanation:
    """One forward pass of ``explain``: logits (B, classes), the recording, and the patch heatmaps (B, gh, gw)
    it yields. ``rollout`` / ``attention`` (last layer, heads averaged) are None without attention, ``cbam``
    (the last spatial gate, (B, H, W)) None without CBAM."""

    logits: torch.Tensor
    recording: AttentionRecording
    rollout: torch.Tensor | None
    attention: torch.Tensor | None
    cbam: torch.Tensor | None

    @property
    def heatmap(self) -> torch.Tensor | None:
        """The model's own explanation: the rollout where it has attention, else the last CBAM gate."""
        return self.rollout if self.rollout is not None else self.cbam


def token_layout(model: nn.Module, num_tokens: int) -> tuple[tuple[int, int], int, str]:
    """(grid_size, num_prefix_tokens, pooling) of a model's attention tokens, read from the attributes the
    zoo's models carry (``grid_size``, ``num_prefix_tokens``, ``global_pool``); a model without a grid
    attribute is taken to attend over a square grid of its last tokens."""
    prefix = getattr(model, "num_prefix_tokens", 0)
    pooling = "token" if prefix > 0 and getattr(model, "global_pool", "token") == "token" else "avg"
    grid = getattr(model, "grid_size", None)
    if grid is None or num_tokens != prefix + grid[0] * grid[1]:
        side = math.isqrt(num_tokens - prefix)
        if side * side != num_tokens - prefix:
            raise ValueError(f"cannot lay {num_tokens} tokens ({prefix} prefix) out on a square patch grid")
        grid = (side, side)
    return tuple(grid), prefix, pooling


@torch.no_grad()
def explain(model: nn.Module, images: torch.Tensor, *, head_fusion: str = "mean",
            discard_ratio: float = 0.0) -> Explanation:
    """Run ``model`` on normalised ``images`` (B, C, H, W) once, recording attention and CBAM gates, and build
    the heatmaps. The rollout uses the maps over the full token set (the last-recorded N); cross-attention or
    maps of another size are left out."""
    with record_attention(model) as rec:
        logits = model(images)
    rollout = attention = cbam = None
    if rec.maps:
        n = rec.maps[-1].shape[-1]
        maps = [a for a in rec.maps if a.shape[-2:] == (n, n)]
        grid, prefix, pooling = token_layout(model, n)
        fused = attention_rollout(maps, head_fusion, discard_ratio, prefix)
        rollout = rollout_heatmap(fused, grid, prefix, pooling)
        attention = rollout_heatmap(fuse_heads(maps[-1].float()), grid, prefix, pooling)
    if rec.cbam:
        cbam = rec.cbam[-1][:, 0].float()
    return Explanation(logits.cpu(), rec, rollout, attention, cbam)


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
            correct += (model(blanked).argmax(dim=-1).cpu() == labels[part]).sum().item()
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
    parts = [explain(model, images[i:i + batch_size].to(device)) for i in range(0, len(images), batch_size)]
    for method in ("rollout", "attention", "cbam"):
        found = [getattr(p, method) for p in parts]
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
