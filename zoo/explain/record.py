"""Recording what attention models look at: every attention map and every CBAM spatial gate a forward pass
computes, in forward order, whatever backend the attention runs. Attention is recorded from the zoo's
``MultiHeadAttention``, timm's ``Attention`` (``VisionTransformer`` and the models built from its blocks, fused
or not), EVA's and CaiT's attention and torch's ``nn.MultiheadAttention`` (torchvision's ``vit_b_16`` family),
without converting the model.

Conventions: attention maps are (B, H, N, M) softmax weights; CBAM gates (B, 1, H, W) after the sigmoid."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers import Attention as TimmAttention
from timm.layers import AttentionRope
from timm.models.cait import ClassAttn, TalkingHeadAttn
from timm.models.eva import EvaAttention
from torch import nn

from ..layers.attention import MultiHeadAttention

# timm attention modules whose non-fused path applies ``attn_drop`` to the weights: recorded at its input.
# ClassAttn (CaiT) gives (B, H, 1, N) class-token rows; TalkingHeadAttn the weights after its head mixing.
TIMM_ATTENTION = (TimmAttention, AttentionRope, EvaAttention, ClassAttn, TalkingHeadAttn)
CLASS_ATTENTION = (ClassAttn,)  # only the class token queries: no token-to-token map to roll out

LOOKED_FOR = ("attention modules (zoo.MultiHeadAttention, timm's Attention, torch's nn.MultiheadAttention) or CBAM "
              "spatial gates (zoo.SpatialAttention, modules with a gate_hook)")


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


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules ``record_attention`` records from: the zoo's, timm's (``TIMM_ATTENTION``: ViT,
    EVA, CaiT) and torch's."""
    return [m for m in model.modules() if isinstance(m, (MultiHeadAttention, nn.MultiheadAttention, *TIMM_ATTENTION))]


def spatial_gates(model: nn.Module) -> list[nn.Module]:
    """The CBAM spatial gates ``record_attention`` records from."""
    return [m for m in model.modules() if _is_spatial_gate(m)]


def num_prefix_tokens(model: nn.Module) -> int:
    """The model's leading tokens without a patch: its ``num_prefix_tokens`` attribute (timm's and the zoo's
    ViTs), else 1 for torchvision's ViT (a ``class_token`` parameter), else those of the zoo attention's relative
    position biases, else 0."""
    prefix = getattr(model, "num_prefix_tokens", None)
    if prefix is None and isinstance(getattr(model, "class_token", None), torch.Tensor):
        prefix = 1
    if prefix is None:
        attn = [m for m in model.modules() if isinstance(m, MultiHeadAttention) and m.rel_pos_bias is not None]
        prefix = attn[0].rel_pos_bias.num_prefix_tokens if attn else 0
    return int(prefix)


def record_attention(model: nn.Module, *, to_cpu: bool = True, allow_empty: bool = False,
                     keep_graph: bool = False) -> AbstractContextManager[AttentionRecording]:
    """Record every attention map and CBAM spatial gate ``model`` computes inside the block::

        with zoo.record_attention(model) as rec:
            model(images)
        rec.maps  # list of (B, H, N, N); rec.cbam: list of (B, 1, H, W); rec.num_prefix_tokens

    Works whatever backend the attention modules run: while recording, each zoo module has a ``weights_hook``
    set, which makes it compute its weights (with the math path where the backend is a fused kernel); each timm
    ``Attention`` runs its own non-fused path (``fused_attn`` off: softmax(q k^T * scale) from its ``qkv``
    projection, read at its ``attn_drop``); each ``nn.MultiheadAttention`` is called with ``need_weights=True,
    average_attn_weights=False``. Tensors are detached (and moved to the CPU with ``to_cpu``), unless
    ``keep_graph``: then they stay on the device in the autograd graph, and are the very tensors the outputs
    are computed from (zoo modules run the math backend), so ``torch.autograd.grad(score, rec.maps)`` gives
    each map's gradient. Modules and hooks are restored on exit, also on error.
    A ``model`` that is not an nn.Module -> TypeError; one with nothing to record (no zoo.MultiHeadAttention,
    no CBAM spatial gate, e.g. a plain torchvision resnet18) -> ValueError, unless ``allow_empty``. Both are
    raised by this call, before the block runs, as is ``keep_graph`` on a compiled model (ValueError naming
    ``zoo.explain.eager``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"record_attention: model must be an nn.Module, got {model!r}")
    if keep_graph and (hasattr(model, "_orig_mod") or any(getattr(m, "_compiled_call_impl", None)
                                                         for m in model.modules())):
        raise ValueError("record_attention(keep_graph=True): gradients do not reach weights recorded inside a "
                         "compiled model; record its eager form: with zoo.explain.eager.eager(model) as plain: ...")
    attn, gates = attention_modules(model), spatial_gates(model)
    if not attn and not gates and not allow_empty:
        raise ValueError(f"record_attention: {type(model).__name__} has nothing to record: looked for "
                         f"{LOOKED_FOR} and found none (zoo.add_cbam(model) adds CBAM gates to a ResNet)")
    return _recording(AttentionRecording(num_prefix_tokens(model)), attn, gates, to_cpu, keep_graph)


def _mha_wants_weights(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of an nn.MultiheadAttention: ask for per-head weights, whatever the caller asked."""
    return args, {**kwargs, "need_weights": True, "average_attn_weights": False}


def _mha_output_through(module: nn.MultiheadAttention, args: tuple, kwargs: dict, output: tuple) -> tuple:
    """Forward hook of an nn.MultiheadAttention under ``keep_graph``: torch returns a copy of its weights that
    the output does not depend on, so recompute the output from that copy, out_proj(weights @ v) (equal to
    torch's in eval mode), so gradients reach the recorded weights."""
    weights = output[1]
    value = args[2] if len(args) > 2 else kwargs["value"]
    if not module.batch_first:
        value = value.transpose(0, 1)
    dim = module.embed_dim
    bias = None if module.in_proj_bias is None else module.in_proj_bias[2 * dim:]
    v = rearrange(F.linear(value, module.in_proj_weight[2 * dim:], bias), "b m (h d) -> b h m d",
                  h=module.num_heads)
    out = module.out_proj(rearrange(weights.to(v.dtype) @ v, "b h n d -> b n (h d)"))
    return (out if module.batch_first else out.transpose(0, 1)), weights


@contextmanager
def _recording(rec: AttentionRecording, attn: list[nn.Module], gates: list[nn.Module], to_cpu: bool,
               keep_graph: bool):
    def keep(store: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
        def hook(t: torch.Tensor) -> None:
            if not keep_graph:
                t = t.detach()
                t = t.cpu() if to_cpu else t
            store.append(t)
        return hook

    zoo_attn = [m for m in attn if isinstance(m, MultiHeadAttention)]
    timm_attn = [m for m in attn if isinstance(m, TIMM_ATTENTION)]
    torch_attn = [m for m in attn if isinstance(m, nn.MultiheadAttention)]
    saved = [(m, "weights_hook", m.weights_hook) for m in zoo_attn]
    saved += [(m, "backend", m.backend) for m in zoo_attn if keep_graph]
    saved += [(m, "fused_attn", m.fused_attn) for m in timm_attn if hasattr(m, "fused_attn")]
    saved += [(m, "gate_hook", m.gate_hook) for m in gates]
    handles = []
    try:
        for m in zoo_attn:
            m.weights_hook = keep(rec.maps)
            if keep_graph:
                m.backend = "math"
        for m in timm_attn:
            if hasattr(m, "fused_attn"):
                m.fused_attn = False
            record = keep(rec.maps)
            handles.append(m.attn_drop.register_forward_hook(lambda mod, args, out, record=record: record(args[0])))
        for m in torch_attn:
            record = keep(rec.maps)
            handles.append(m.register_forward_pre_hook(_mha_wants_weights, with_kwargs=True))
            if keep_graph:
                if not m._qkv_same_embed_dim:
                    raise ValueError("record_attention(keep_graph=True) needs nn.MultiheadAttention with one packed "
                                     "in_proj_weight (kdim == vdim == embed_dim)")
                handles.append(m.register_forward_hook(_mha_output_through, with_kwargs=True))
            handles.append(m.register_forward_hook(lambda mod, args, out, record=record: record(out[1])))
        for m in gates:
            m.gate_hook = keep(rec.cbam)
        yield rec
    finally:
        for handle in handles:
            handle.remove()
        for m, name, old in saved:
            setattr(m, name, old)
