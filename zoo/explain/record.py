"""Recording what attention models look at: every attention map (``zoo.MultiHeadAttention``) and every CBAM
spatial gate a forward pass computes, in forward order, whatever backend the attention runs.

Conventions: attention maps are (B, H, N, M) softmax weights; CBAM gates (B, 1, H, W) after the sigmoid."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..layers.attention import MultiHeadAttention


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
