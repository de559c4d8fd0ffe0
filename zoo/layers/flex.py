"""The "flex" backend: ``torch.nn.attention.flex_attention`` (FlexAttention, He et al. 2024,
https://pytorch.org/blog/flexattention/) with a ``BlockMask`` built from a ``zoo.masks.spec``, so blocks of
the (N, M) score matrix that the mask rules out are skipped rather than computed and thrown away.

- The block mask is built once per (spec, N, M, device) and cached (``block_mask``); flex_attention itself
  is compiled once per process (``torch.compile``) with the batch dimension dynamic, so a new batch size (the
  last, partial batch of an epoch) reuses the kernel; a new N compiles again, a new window or new lengths at the
  same shape do not, as they enter ``mask_mod`` as tensors. Under an outer ``torch.compile`` the block mask is
  built outside the graph (a graph break).
- The 2D relative position bias enters as a ``score_mod`` (score + bias[h, q, k]), inside the compiled
  function so the bias is an input of the graph, not a constant baked into it.
- Masks: a spec, ``is_causal`` (folded into the spec) or none. A tensor mask cannot say which blocks are
  empty without reading all N x M of it, so it is refused with a pointer to ``zoo.masks.spec`` and "sdpa".
- Rows with no key (e.g. lengths[b] == 0) give output 0, as in every backend (``row_ok`` from the spec); so do
  zero queries or zero keys (N = 0, an empty context), which never reach the kernel.
- float32, float16 and bfloat16 only (what the CPU kernel takes): float64 is refused, naming "math" / "sdpa".
- Attention dropout does not exist in flex: refused. Backward on the CPU does not exist in torch 2.14:
  refused with grad enabled, naming the banded path ("chunked" with a windowed spec, or "auto").
- On the CPU, heads of at most 16 channels get their keys padded to a multiple of 16, the padding masked out:
  torch 2.14's compiled CPU kernel returns wrong values or NaN there when the number of keys is 8 modulo 16
  (8, 24, 40, ...; measured against SDPA with heads of 8 and 16 channels; 24 and more were right).
- CUDA forward and backward is the same code path; this project's tests run on a CPU and check the forward.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .masks import MaskSpec

if TYPE_CHECKING:  # the masks' carrier is backends'; only its annotations are needed here
    from .backends import Masking

CPU_KEY_MULTIPLE = 16  # keys padded to a multiple of this on the CPU for heads of at most 16 channels


def padded_keys(m: int, head_dim: int, device: torch.device) -> int:
    """How many keys the kernel is given for ``m`` real ones: ``m``, or on the CPU with heads of at most 16
    channels ``m`` rounded up to a multiple of 16 (the module docstring says why)."""
    if device.type != "cpu" or head_dim > 16 or m % CPU_KEY_MULTIPLE == 0:
        return m
    return m + CPU_KEY_MULTIPLE - m % CPU_KEY_MULTIPLE


@torch.compiler.disable  # a graph break under torch.compile: the cached mask enters the graph as an input
@lru_cache(maxsize=64)
def block_mask(spec: MaskSpec, n: int, m: int, device: torch.device, m_padded: int | None = None) -> BlockMask:
    """The ``BlockMask`` of ``spec`` for n queries and m keys on ``device``, built once and cached; with
    ``m_padded`` > m, for that many keys, the ones past m masked out."""
    batch = None if spec.lengths is None else len(spec.lengths)
    rule = spec.mask_mod(n, m, device)
    if m_padded is None or m_padded == m:
        return create_block_mask(rule, batch, None, n, m, device=device)

    def real_keys_only(b, h, q_idx, kv_idx):
        return rule(b, h, q_idx, kv_idx) & (kv_idx < m)

    return create_block_mask(real_keys_only, batch, None, n, m_padded, device=device)


def _flex(q, k, v, block_mask, rel_bias):
    if rel_bias is None:
        return flex_attention(q, k, v, block_mask=block_mask)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + rel_bias[h, q_idx, kv_idx]

    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)


compiled_flex = torch.compile(_flex)  # compiles at its first call; this module loads on first use


def _refuse(masking: Masking, q, k, v, dropout_p: float) -> None:
    if masking.mask is not None:
        raise ValueError("the flex backend takes its mask as a zoo.masks.spec(causal=..., window=..., "
                         f"lengths=...), got a {masking.mask.dtype} tensor; pass a spec, or use backend='sdpa' "
                         "for a tensor mask")
    if dropout_p > 0:
        raise ValueError(f"the flex backend has no attention dropout, got attn_drop={dropout_p}; use "
                         "backend='chunked' (banded with a windowed spec) or 'sdpa', or attn_drop=0")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the flex backend computes in float32, float16 or bfloat16, got {q.dtype}; cast the "
                         "module (module.float()) or use backend='math' or 'sdpa' for float64")
    if q.device.type == "mps":
        raise ValueError("the flex backend runs on CUDA and the CPU, not on Apple MPS; use backend='sdpa', or "
                         "'chunked' with a windowed zoo.masks.spec")
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("the flex backend has no backward on the CPU (torch 2.14); for training on a CPU use "
                         "backend='auto' or 'chunked' with a windowed zoo.masks.spec (the banded path), or run "
                         "flex under torch.no_grad()")


def flex_attention_spec(q, k, v, masking: Masking, dropout_p: float) -> torch.Tensor:
    """(B, H, N, D) attention through FlexAttention with the block mask of ``masking``'s spec."""
    _refuse(masking, q, k, v, dropout_p)
    if masking.n == 0 or masking.m == 0:  # no query or no key: nothing to attend (flex's kernel divides by zero)
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    spec = masking.spec or MaskSpec()
    if masking.causal:
        spec = replace(spec, causal=True)
    rel_bias = None if masking.rel_bias is None else masking.rel_bias.to(q.dtype)
    m_padded = padded_keys(masking.m, q.shape[-1], q.device)
    if m_padded > masking.m:  # zero keys and values past the real ones, which the block mask leaves out
        k, v = (F.pad(t, (0, 0, 0, m_padded - masking.m)) for t in (k, v))
        rel_bias = None if rel_bias is None else F.pad(rel_bias, (0, m_padded - masking.m))
    unmasked = spec == MaskSpec() and m_padded == masking.m
    blocks = None if unmasked else block_mask(spec, masking.n, masking.m, q.device, m_padded)
    if blocks is None or blocks.shape[0] == 1:  # a block mask of one batch row broadcasts over any batch size
        for t in (q, k, v):
            torch._dynamo.maybe_mark_dynamic(t, 0)
    # N and M stay static on every device (a new N compiles again, as the module says): the kernel torch 2.14
    # compiles for the CPU with a dynamic N, which its automatic dynamic shapes choose at the second N, returned
    # wrong values with a position bias (measured against math)
    for t, dim in ((q, 2), (k, 2), (v, 2), (rel_bias, 1), (rel_bias, 2)):
        if t is not None:
            torch._dynamo.mark_static(t, dim)
    out = compiled_flex(q, k, v, blocks, rel_bias)
    if spec == MaskSpec():
        return out
    return out * spec.row_ok(masking.n, masking.m, device=q.device)
