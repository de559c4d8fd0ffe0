"""The attention computations behind ``zoo.MultiHeadAttention``'s backends, on heads already split:
q (B, H, N, D), k / v (B, H, M, D). ``Masking`` gathers everything that restricts or biases the (N, M) score
matrix and hands it out by query rows, so the chunked backend never holds N x M of it.

- ``math_attention``: explicit scores and softmax, the reference, and the one that returns weights;
- ``sdpa_attention``: ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where torch has them);
- ``chunked_attention``: queries in chunks, each recomputed in backward (activation checkpointing);
- ``linear_attention``: elu+1 kernel attention (Katharopoulos et al. 2020, https://arxiv.org/abs/2006.16236),
  an approximation of softmax attention, linear in N.

A query row whose keys are all masked gets output 0, never NaN: its row is opened before the softmax and
zeroed after (``row_ok``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .masks import causal_mask


@dataclass
class Masking:
    """Everything that restricts or biases the (N, M) score matrix, sliced lazily by query rows so the
    chunked backend never materialises N x M of it."""

    mask: torch.Tensor | None  # user mask, 4-D, broadcastable to (B, H, N, M)
    causal: bool
    rel_bias: torch.Tensor | None  # (H, N, M) float
    n: int
    m: int

    @property
    def empty(self) -> bool:
        return self.mask is None and not self.causal and self.rel_bias is None

    @property
    def boolean(self) -> bool:
        """Whether ``bias`` hands out a bool mask (True = attend) rather than a float one; known without
        looking at a tensor's values, so it holds while torch.fx traces too."""
        return self.rel_bias is None and (self.mask is None or self.mask.dtype == torch.bool)

    def bias(self, rows: slice, dtype: torch.dtype, device) -> tuple[torch.Tensor | None, ...]:
        """(bias, row_ok) for query rows ``rows``: bias is bool (True = attend) or float (added), with
        fully-masked rows opened up so softmax stays finite; row_ok (..., rows, 1) is False for those rows,
        whose output the caller must zero. Both None when nothing masks."""
        if self.empty:
            return None, None
        allowed = None
        additive = None
        if self.mask is not None:
            part = self.mask[..., rows, :] if self.mask.shape[-2] == self.n else self.mask
            if part.dtype == torch.bool:
                allowed = part
            else:
                additive = part
        if self.causal:
            causal = causal_mask(self.n, self.m, rows=rows, device=device)
            allowed = causal if allowed is None else allowed & causal
        if self.rel_bias is not None:
            part = self.rel_bias[:, rows]
            additive = part if additive is None else additive + part
        if additive is None:
            row_ok = allowed.any(dim=-1, keepdim=True)
            return allowed | ~row_ok, row_ok
        additive = additive.to(dtype)
        if allowed is not None:
            additive = additive.masked_fill(~allowed, float("-inf"))
        row_ok = (additive != float("-inf")).any(dim=-1, keepdim=True)
        return additive.masked_fill(~row_ok, 0.0), row_ok


def math_attention(q, k, v, bias, row_ok, dropout_p: float, need_weights: bool, boolean: bool = True):
    """Reference softmax attention. q: (B, H, N, D), k/v: (B, H, M, D); bias broadcastable to (B, H, N, M),
    bool (True = attend) when ``boolean``, else float (added)."""
    scores = torch.einsum("bhnd,bhmd->bhnm", q * q.shape[-1] ** -0.5, k)
    if bias is not None:
        scores = scores.masked_fill(~bias, float("-inf")) if boolean else scores + bias
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
    mask = masking.mask
    key_mask_only = mask is None or (mask.dtype == torch.bool and mask.shape[-2] == 1)
    if masking.rel_bias is not None or not key_mask_only:
        raise ValueError("the linear backend supports only boolean key masks of shape (B, 1, 1, M) and "
                         "is_causal; use backend='sdpa' or 'math' for other masks or a relative position "
                         "bias")
    dtype = q.dtype
    q, k, v = (_elu_feature(q.float()), _elu_feature(k.float()), v.float())
    if mask is not None:
        k = k * mask[..., 0, :, None]  # masked keys contribute nothing
    if masking.causal:
        if masking.n != masking.m:
            raise ValueError("the linear backend needs N == M with is_causal (no KV cache)")
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


def chunked_attention(q, k, v, masking: Masking, dropout_p: float, need_weights: bool, chunk_size: int):
    """Math attention over ``chunk_size`` query rows at a time; in training each chunk is recomputed in
    backward (activation checkpointing), so memory stays linear in N for training too."""
    recompute = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs, weights = [], []
    for start in range(0, masking.n, chunk_size):
        rows = slice(start, start + chunk_size)

        def chunk(q_rows, k, v, rows=rows):
            bias, row_ok = masking.bias(rows, q_rows.dtype, q_rows.device)
            return math_attention(q_rows, k, v, bias, row_ok, dropout_p, need_weights, masking.boolean)

        if recompute and not need_weights:
            out, w = checkpoint(chunk, q[:, :, rows], k, v, use_reentrant=False)
        else:
            out, w = chunk(q[:, :, rows], k, v)
        outs.append(out)
        weights.append(w)
    return torch.cat(outs, dim=2), (torch.cat(weights, dim=2) if need_weights else None)


def attend(backend: str, q, k, v, masking: Masking, dropout_p: float, need_weights: bool, chunk_size: int):
    """(out (B, H, N, D), weights (B, H, N, M) or None) from the named backend (not "auto")."""
    if backend == "linear":
        return linear_attention(q, k, v, masking, need_weights)
    if backend == "sdpa":
        only_causal = masking.causal and masking.mask is None and masking.rel_bias is None
        if only_causal and masking.n == masking.m:  # torch's is_causal is top-left aligned when N != M
            return sdpa_attention(q, k, v, None, None, dropout_p, is_causal=True), None
        bias, row_ok = masking.bias(slice(None), q.dtype, q.device)
        return sdpa_attention(q, k, v, bias, row_ok, dropout_p, is_causal=False), None
    if backend == "math":
        bias, row_ok = masking.bias(slice(None), q.dtype, q.device)
        return math_attention(q, k, v, bias, row_ok, dropout_p, need_weights, masking.boolean)
    return chunked_attention(q, k, v, masking, dropout_p, need_weights, chunk_size)
