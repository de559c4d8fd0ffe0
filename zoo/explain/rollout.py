"""Attention rollout (Abnar & Zuidema 2020, https://arxiv.org/abs/2005.00928), patch heatmaps and
``explain`` (one heatmap per image for any zoo model: rollout for attention models, the last CBAM gate for CNNs).

Conventions: attention maps are (B, H, N, N) softmax weights, rollouts (B, N, N), heatmaps (B, gh, gw) over
the patch grid (larger = more important)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .record import AttentionRecording, num_prefix_tokens, record_attention

HEAD_FUSIONS = ("mean", "max", "min")
POOLINGS = ("token", "avg")


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


def attention_rollout(maps: Sequence[torch.Tensor] | AttentionRecording, head_fusion: str = "mean",
                      discard_ratio: float = 0.0, num_prefix_tokens: int | None = None) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020): how much each output token draws on each input token through
    all layers, counting the residual path.

    Per layer: fuse heads (``head_fusion``), optionally zero the lowest ``discard_ratio`` of the fused weights
    (never in the first ``num_prefix_tokens`` columns), A' = rownorm(0.5 * A + 0.5 * I). Then
    R = A_L' @ ... @ A_1'. maps: list of (B, H, N, N) in forward order, or a whole ``AttentionRecording``.
    ``num_prefix_tokens`` defaults to what the recording knows of the model: ``rec.num_prefix_tokens`` when
    ``maps`` is ``rec.maps`` (or ``rec``); for a plain list, 1 (a class token, the ViT convention).
    Returns (B, N, N) float32; rows sum to 1.
    """
    if isinstance(maps, AttentionRecording):
        maps = maps.maps
    if num_prefix_tokens is None:
        num_prefix_tokens = getattr(maps, "num_prefix_tokens", 1)
    _check_maps(maps)
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    n = maps[0].shape[-1]
    if isinstance(num_prefix_tokens, bool) or not isinstance(num_prefix_tokens, int) or not 0 <= num_prefix_tokens < n:
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


def patch_grid(model: nn.Module) -> tuple[int, int] | None:
    """The (gh, gw) patch grid a ViT's tokens lie on, non-square included: the zoo's ``grid_size``, timm's
    ``patch_embed.grid_size``, torchvision's ``image_size // patch_size``; None for a model without one."""
    grid = getattr(model, "grid_size", None) or getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if grid is None and isinstance(getattr(model, "image_size", None), int) and hasattr(model, "patch_size"):
        grid = (model.image_size // model.patch_size,) * 2
    return None if grid is None else (int(grid[0]), int(grid[1]))


def token_layout(model: nn.Module, num_tokens: int) -> tuple[tuple[int, int], int, str]:
    """(grid_size, num_prefix_tokens, pooling) of a model's attention tokens, read from the attributes the
    zoo's models carry (``grid_size``, ``num_prefix_tokens``, ``global_pool``) and timm's / torchvision's
    (``patch_grid``); a model without a grid is taken to attend over a square grid of its last tokens."""
    prefix = num_prefix_tokens(model)
    pooling = "token" if prefix > 0 and getattr(model, "global_pool", "token") == "token" else "avg"
    grid = patch_grid(model)
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
    with record_attention(model, allow_empty=True) as rec:
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
