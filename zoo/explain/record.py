"""Recording what attention models look at: every attention map (``zoo.MultiHeadAttention``) and every CBAM
spatial gate a forward pass computes, in forward order, whatever backend the attention runs.

Conventions: attention maps are (B, H, N, M) softmax weights; CBAM gates (B, 1, H, W) after the sigmoid."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..layers.attention import MultiHeadAttention

LOOKED_FOR = "zoo.MultiHeadAttention modules or CBAM spatial gates (zoo.SpatialAttention, modules with a gate_hook)"


class AttentionMaps(list):
    """The recorded (B, H, N, M) maps, a plain list that also carries the model's ``num_prefix_tokens``, so
    ``zoo.attention_rollout(rec.maps)`` leaves the model's class token (and other prefix tokens) alone."""

    def __init__(self, num_prefix_tokens: int = 0):
        super().__init__()
        self.num_prefix_tokens = num_prefix_tokens


@dataclass
class AttentionRecording:
    """What one ``record_attention`` block saw, in forward order: ``maps`` (B, H, N, M) attention weights, one
    per MultiHeadAttention call; ``cbam`` (B, 1, H, W) spatial gates after the sigmoid, one per CBAM call;
    ``num_prefix_tokens``: the model's leading tokens without a patch (its ``num_prefix_tokens`` attribute, as
    timm's and the zoo's ViTs have; else those of its relative position biases; else 0)."""

    num_prefix_tokens: int = 0
    maps: AttentionMaps = field(default_factory=AttentionMaps)
    cbam: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self):
        self.maps.num_prefix_tokens = self.num_prefix_tokens

    def clear(self) -> None:
        self.maps.clear()
        self.cbam.clear()


def _is_spatial_gate(module: nn.Module) -> bool:
    """zoo.cbam.SpatialAttention (and anything else that offers the same ``gate_hook`` attribute)."""
    return hasattr(module, "gate_hook")


def _num_prefix_tokens(model: nn.Module, attn: list[MultiHeadAttention]) -> int:
    prefix = getattr(model, "num_prefix_tokens", None)
    if prefix is None:
        prefix = next((m.rel_pos_bias.num_prefix_tokens for m in attn if m.rel_pos_bias is not None), 0)
    return int(prefix)


def record_attention(model: nn.Module, *, to_cpu: bool = True,
                     allow_empty: bool = False) -> AbstractContextManager[AttentionRecording]:
    """Record every attention map and CBAM spatial gate ``model`` computes inside the block::

        with zoo.record_attention(model) as rec:
            model(images)
        rec.maps  # list of (B, H, N, N); rec.cbam: list of (B, 1, H, W); rec.num_prefix_tokens

    Works whatever backend the attention modules run: while recording each one has a ``weights_hook`` set,
    which makes it compute its weights (with the math path where the backend is a fused kernel). Tensors are
    detached (and moved to the CPU with ``to_cpu``). The previous hooks are restored on exit, also on error.
    A ``model`` that is not an nn.Module -> TypeError; one with nothing to record (no zoo.MultiHeadAttention,
    no CBAM spatial gate, e.g. a plain torchvision resnet18) -> ValueError, unless ``allow_empty``. Both are
    raised by this call, before the block runs."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"record_attention: model must be an nn.Module, got {model!r}")
    attn = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    gates = [m for m in model.modules() if _is_spatial_gate(m)]
    if not attn and not gates and not allow_empty:
        raise ValueError(f"record_attention: {type(model).__name__} has nothing to record: looked for "
                         f"{LOOKED_FOR} and found none (zoo.add_cbam(model) adds CBAM gates to a ResNet)")
    return _recording(AttentionRecording(_num_prefix_tokens(model, attn)), attn, gates, to_cpu)


@contextmanager
def _recording(rec: AttentionRecording, attn: list[nn.Module], gates: list[nn.Module], to_cpu: bool):
    def keep(store: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
        def hook(t: torch.Tensor) -> None:
            t = t.detach()
            store.append(t.cpu() if to_cpu else t)
        return hook

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
