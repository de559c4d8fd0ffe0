"""The attention computations behind ``zoo.MultiHeadAttention``'s backends, on heads already split:
q (B, H, N, D), k / v (B, H, M, D). ``Masking`` gathers everything that restricts or biases the (N, M) score
matrix and hands it out by query rows, so the chunked backend never holds N x M of it.

- ``math_attention``: explicit scores and softmax, the reference, and the one that returns weights;
- ``sdpa_attention``: ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where torch has them);
- ``chunked_attention``: queries in chunks, each recomputed in backward (activation checkpointing);
- ``linear_attention``: elu+1 kernel attention (Katharopoulos et al. 2020, https://arxiv.org/abs/2006.16236),
  an approximation of softmax attention, linear in N.

A query row whose keys are all masked gets output 0, never NaN: its row is opened before the softmax and
zeroed after (``row_ok``). Under fp16 / bf16 (autocast or a half-precision module) a float mask keeps its meaning:
finite values are clamped to the dtype's range (-1e9 stays a finite penalty, never -inf, so only true -inf or
False marks a key as masked), the math backend adds it to the scores in fp32, and linear attention runs its
reductions in fp32 outside autocast. A float mask may have any float dtype, whatever the input's (an fp16 mask
with fp32 input is read in fp32)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .checks import tracing
from .masks import MaskSpec, causal_mask


@dataclass
class Masking:
    """Everything that restricts or biases the (N, M) score matrix, sliced lazily by query rows (and key
    columns) so the chunked backend never materialises N x M of it."""

    mask: torch.Tensor | None  # user mask, 4-D, broadcastable to (B, H, N, M)
    causal: bool
    rel_bias: torch.Tensor | None  # (H, N, M) float
    n: int
    m: int
    spec: MaskSpec | None = None  # rules (zoo.masks.spec), never together with a tensor ``mask``

    @property
    def empty(self) -> bool:
        return self.mask is None and not self.causal and self.rel_bias is None and self.spec is None

    @property
    def boolean(self) -> bool:
        """Whether ``bias`` hands out a bool mask (True = attend) rather than a float one; known without
        looking at a tensor's values, so it holds while torch.fx traces too."""
        return self.rel_bias is None and (self.mask is None or self.mask.dtype == torch.bool)

    @property
    def banded(self) -> bool:
        """Whether a window limits the keys each query can reach, so a chunk of queries needs only a band."""
        return self.spec is not None and self.spec.window is not None

    def bias(self, rows: slice, dtype: torch.dtype, device,
             cols: slice = slice(None)) -> tuple[torch.Tensor | None, ...]:
        """(bias, row_ok) for query rows ``rows`` and key columns ``cols``: bias is bool (True = attend) or float
        (added), with fully-masked rows opened up so softmax stays finite; row_ok (..., rows, 1) is False for
        those rows, whose output the caller must zero. Both None when nothing masks. A row counts as fully
        masked when no key of ``cols`` is allowed: callers pass every key a row may attend."""
        if self.empty:
            return None, None
        allowed = None
        additive = None
        if self.mask is not None:
            part = self.mask[..., rows, :] if self.mask.shape[-2] == self.n else self.mask
            part = part[..., cols] if self.mask.shape[-1] == self.m else part
            if part.dtype == torch.bool:
                allowed = part
            else:
                additive = part
        if self.causal:
            causal = causal_mask(self.n, self.m, rows=rows, device=device)[:, cols]
            allowed = causal if allowed is None else allowed & causal
        if self.spec is not None:
            ruled = self.spec.dense(self.n, self.m, rows=rows, cols=cols, device=device)
            allowed = ruled if allowed is None else allowed & ruled
        if self.rel_bias is not None:
            part = self.rel_bias[:, rows, cols]
            additive = part if additive is None else additive + part
        if additive is None:
            row_ok = allowed.any(dim=-1, keepdim=True)
            return allowed | ~row_ok, row_ok
        if allowed is None and self.mask is None:  # only the (finite) relative bias: no row can be fully masked
            return additive.to(dtype), None
        if allowed is not None:
            additive = additive.masked_fill(~allowed, float("-inf"))
        row_ok = (additive != float("-inf")).any(dim=-1, keepdim=True)  # before the cast, which may add -inf
        return _cast_finite(additive.masked_fill(~row_ok, 0.0), dtype), row_ok


def _cast_finite(additive: torch.Tensor, dtype) -> torch.Tensor:
    """``additive`` in ``dtype`` with its finite values clamped to the dtype's range: -1e9 becomes fp16's -65504
    (still a penalty that zeroes the key's weight) rather than -inf (which would read as masked); -inf stays."""
    if tracing():  # torch.fx: dtype is a graph value; traced masks are bool specs plus a small relative bias
        return additive.to(dtype)
    info = torch.finfo(dtype)
    additive = additive.to(torch.promote_types(additive.dtype, dtype))  # clamp in the wider (fp16 < fp32's max)
    return torch.where(additive == float("-inf"), additive, additive.clamp(info.min, info.max)).to(dtype)


def math_attention(q, k, v, bias, row_ok, dropout_p: float, need_weights: bool, boolean: bool = True):
    """Reference softmax attention. q: (B, H, N, D), k/v: (B, H, M, D); bias broadcastable to (B, H, N, M),
    bool (True = attend) when ``boolean``, else float (added)."""
    scores = torch.einsum("bhnd,bhmd->bhnm", q * q.shape[-1] ** -0.5, k)
    if bias is not None:  # a float bias is added in fp32: fp16's -65504 plus a negative score would overflow
        scores = scores.masked_fill(~bias, float("-inf")) if boolean else scores.float() + bias
    weights = scores.softmax(dim=-1, dtype=torch.float32)
    if row_ok is not None:
        weights = weights * row_ok
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = torch.einsum("bhnm,bhmd->bhnd", dropped.to(v.dtype), v)
    return out, (weights if need_weights else None)


def sdpa_attention(q, k, v, bias, row_ok, dropout_p: float, is_causal: bool):
    """bias: None, bool (True = attend) or float in q's dtype (``Masking.bias`` casts it)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=is_causal)
    return out if row_ok is None else out * row_ok


def _elu_feature(t: torch.Tensor) -> torch.Tensor:
    return F.elu(t) + 1.0


def _divide_or_zero(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where den == 0 (every key masked); finite gradients there too, unlike a clamp,
    whose backward divides by tiny**2 == 0."""
    return num / den.masked_fill(den == 0, 1.0)


def linear_attention(q, k, v, masking: Masking, need_weights: bool):
    """phi(q) (phi(k)^T v) / (phi(q) . sum phi(k)) with phi = elu + 1. Supports key masks of shape
    (B or 1, H or 1, 1, M) and is_causal (prefix sums); other masks -> ValueError."""
    if masking.spec is not None:
        if masking.spec.window is not None:
            raise ValueError("the linear backend cannot take a window; use backend='chunked' or 'auto' for a "
                             "mask spec with a window")
        lengths = masking.spec.lengths
        key_mask = None if lengths is None else MaskSpec(lengths=lengths).dense(1, masking.m, device=q.device)
        masking = Masking(key_mask, masking.causal or masking.spec.causal, masking.rel_bias, masking.n, masking.m)
    mask = masking.mask
    key_mask_only = mask is None or (mask.dtype == torch.bool and mask.shape[-2] == 1)
    if masking.rel_bias is not None or not key_mask_only:
        raise ValueError("the linear backend supports only boolean key masks of shape (B, 1, 1, M) and "
                         "is_causal; use backend='sdpa' or 'math' for other masks or a relative position "
                         "bias")
    if masking.causal and masking.n != masking.m:
        raise ValueError("the linear backend needs N == M with is_causal (no KV cache)")
    dtype = q.dtype  # under autocast: the dtype the projections ran in, which the output returns to
    # fp32 sums: in fp16 the normaliser (~ head_dim * M) overflows 65,504 from ~1,000 keys on; .float() alone
    # would not do, as autocast runs every einsum in its own dtype again
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = (_elu_feature(q.float()), _elu_feature(k.float()), v.float())
        if mask is not None:
            k = k * mask[..., 0, :, None]  # masked keys contribute nothing
        if masking.causal:
            kv = torch.einsum("bhmd,bhme->bhmde", k, v).cumsum(dim=2)
            num = torch.einsum("bhnd,bhnde->bhne", q, kv)
            den = torch.einsum("bhnd,bhnd->bhn", q, k.cumsum(dim=2))[..., None]
        else:
            num = torch.einsum("bhnd,bhde->bhne", q, torch.einsum("bhmd,bhme->bhde", k, v))
            den = torch.einsum("bhnd,bhd->bhn", q, k.sum(dim=2))[..., None]
        out = _divide_or_zero(num, den)  # den = 0 only when every key is masked
        weights = None
        if need_weights:
            affinity = torch.einsum("bhnd,bhmd->bhnm", q, k)
            if masking.causal:
                affinity = affinity * causal_mask(masking.n, masking.m, device=q.device)
            weights = _divide_or_zero(affinity, affinity.sum(-1, keepdim=True))
    return out.to(dtype), weights


def band_rows(chunk_size: int, window: int) -> int:
    """Query rows per chunk on the banded path: about twice the window (a chunk then reads chunk + 2 * window
    keys, at most twice the keys its rows need), at least 64 rows to keep the per-chunk overhead small, and at
    most ``chunk_size``."""
    return min(chunk_size, max(64, 2 * window))


def band_block(chunk_size: int, reach: int) -> int:
    """Key block of the banded path: keys are split into blocks once and each band is whole blocks, so the
    backward sums every block's gradient from the few bands that read it. (A band sliced out of k would, in
    backward, write a zero-filled gradient of all N keys per chunk: time quadratic in N.) The block divides both
    the chunk and the reach where they share a divisor of at least 16, so the bands are then exact."""
    common = math.gcd(chunk_size, reach)
    return common if common >= 16 else 16


def recompute_keeps_dropout(device: torch.device) -> bool:
    """Whether torch's activation checkpointing sets ``device``'s generator back for the recomputation, so a
    recomputed dropout mask is the forward's: it saves the CPU's and that of a device module with
    ``_initialized`` (CUDA's; not MPS's, whose recomputed masks would differ, silently)."""
    return device.type == "cpu" or hasattr(torch.get_device_module(device.type), "_initialized")


def chunked_attention(q, k, v, masking: Masking, dropout_p: float, need_weights: bool, chunk_size: int):
    """Math attention over ``chunk_size`` query rows at a time.

    Banded when the mask is a spec with a window and no weights are wanted: each chunk of ``band_rows`` rows
    attends only the keys its window can reach (``MaskSpec.key_range``), so work and memory grow linearly in
    N, and autograd runs through it plainly (as lucidrains' local-attention); each band goes through SDPA.
    Otherwise each chunk sees every key and in training is recomputed in backward (activation checkpointing),
    so memory stays linear in N; not with dropout on a device whose generator checkpointing does not restore
    (``recompute_keeps_dropout``), where the chunks' activations are kept instead."""
    banded = masking.banded and not need_weights
    recompute = (not banded and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
                 and (dropout_p == 0 or recompute_keeps_dropout(q.device)))
    if banded:
        chunk_size = band_rows(chunk_size, masking.spec.reach)
        block = band_block(chunk_size, masking.spec.reach)
        q_chunks, k_blocks, v_blocks = q.split(chunk_size, dim=2), k.split(block, dim=2), v.split(block, dim=2)
    outs, weights = [], []
    for index, start in enumerate(range(0, masking.n, chunk_size)):
        rows = slice(start, start + chunk_size)
        cols = masking.spec.key_range(rows, masking.n, masking.m) if banded else slice(None)
        band = None
        if banded and cols.stop > cols.start:  # the band widened to whole key blocks
            first, last = cols.start // block, -(-cols.stop // block)
            cols = slice(first * block, min(last * block, masking.m))
            band = torch.cat(k_blocks[first:last], dim=2), torch.cat(v_blocks[first:last], dim=2)

        def chunk(q_rows, k, v, rows=rows, cols=cols):
            bias, row_ok = masking.bias(rows, q_rows.dtype, q_rows.device, cols)
            if banded:  # SDPA's kernel per band: 10-20% faster than the explicit softmax here (CPU, fp32)
                return sdpa_attention(q_rows, k, v, bias, row_ok, dropout_p, is_causal=False), None
            return math_attention(q_rows, k, v, bias, row_ok, dropout_p, need_weights, masking.boolean)

        if band is not None:
            out, w = chunk(q_chunks[index], *band)
        elif recompute and not need_weights:
            out, w = checkpoint(chunk, q[:, :, rows], k, v, use_reentrant=False)
        else:
            out, w = chunk(q[:, :, rows], k[:, :, cols], v[:, :, cols])
        outs.append(out)
        weights.append(w)
    return torch.cat(outs, dim=2), (torch.cat(weights, dim=2) if need_weights else None)


BANDED_MIN_N = 1024  # below this many queries the dense kernels win (per-chunk overhead), see auto_sparse


def auto_sparse(device: torch.device, grad_enabled: bool, n: int, window: int, dropout_p: float) -> str | None:
    """The fixed rule "auto" follows for a mask spec with a window (from the benchmark, never timed at run
    time): the backend that skips the masked work, or None to stay dense. ``window``: the spec's ``reach``
    (the largest |i - j| it allows; about window * (gw + 1) for a 2D neighbourhood on a grid gw wide).

    - Dense ("sdpa") unless the band is sparse: N >= ``BANDED_MIN_N`` and the 2 * window + 1 keys a query sees
      are at most a quarter of N.
    - On CUDA without attention dropout: "flex", forward and backward (grad_enabled does not matter there).
    - Otherwise (the CPU, or dropout, which flex lacks): "chunked", i.e. the banded path. On the CPU "flex"
      is never chosen: with grad enabled it has no backward in torch 2.14, and without grad the banded path
      measured as fast or faster than flex's compiled kernel, which also costs a compile per shape."""
    if n < BANDED_MIN_N or 4 * (2 * window + 1) > n:
        return None
    if device.type == "cuda" and dropout_p == 0.0:
        return "flex"
    return "chunked"


def attend(backend: str, q, k, v, masking: Masking, dropout_p: float, need_weights: bool, chunk_size: int):
    """(out (B, H, N, D), weights (B, H, N, M) or None) from the named backend (not "auto")."""
    if backend == "flex":
        from .flex import flex_attention_spec  # torch.nn.attention.flex_attention loads only when used

        return flex_attention_spec(q, k, v, masking, dropout_p), None
    if backend == "linear":
        return linear_attention(q, k, v, masking, need_weights)
    if backend == "sdpa":
        only_causal = masking.causal and masking.mask is None and masking.rel_bias is None and masking.spec is None
        if only_causal and masking.n == masking.m:  # torch's is_causal is top-left aligned when N != M
            return sdpa_attention(q, k, v, None, None, dropout_p, is_causal=True), None
        bias, row_ok = masking.bias(slice(None), q.dtype, q.device)
        return sdpa_attention(q, k, v, bias, row_ok, dropout_p, is_causal=False), None
    if backend == "math":
        bias, row_ok = masking.bias(slice(None), q.dtype, q.device)
        return math_attention(q, k, v, bias, row_ok, dropout_p, need_weights, masking.boolean)
    return chunked_attention(q, k, v, masking, dropout_p, need_weights, chunk_size)
