"""Multi-head attention, the block every model in the zoo is made of (Vaswani et al. 2017,
https://arxiv.org/abs/1706.03762).

One module, several interchangeable backends that compute the same function:

- ``sdpa``: ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where torch has them);
- ``math``: explicit scores and softmax, the reference, and the one that returns weights;
- ``chunked``: queries in chunks of ``chunk_size``, never more than chunk x M scores alive; in training
  each chunk is recomputed in backward (activation checkpointing), so memory stays linear in N there too;
- ``linear``: kernel attention with the elu+1 feature map (Katharopoulos et al. 2020,
  https://arxiv.org/abs/2006.16236), linear in N. An *approximation*: it does not equal softmax attention.

Masks follow ``F.scaled_dot_product_attention``: bool means True = may attend, float is added to the scores;
either broadcasts to (B, H, N, M). A query that may attend no key gets attention output 0 (so the module
returns ``proj.bias``, as ``torch.nn.MultiheadAttention`` does), never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from .masks import causal_mask
from .posembed import RelativePositionBias2D

BACKENDS = ("auto", "sdpa", "math", "chunked", "linear")
_auto_backend = "sdpa"


def set_backend(name: str) -> str:
    """Set what ``backend="auto"`` resolves to, process-wide (existing modules too). Returns the old one."""
    global _auto_backend
    if name not in BACKENDS[1:]:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS[1:]}")
    old, _auto_backend = _auto_backend, name
    return old


def get_backend() -> str:
    """What ``backend="auto"`` currently resolves to."""
    return _auto_backend


class KVCache:
    """Keys and values (B, H, T, head_dim) of the steps decoded so far, for incremental causal attention."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new keys/values along the sequence axis and return all of them."""
        if self.k is not None and (self.k.shape[:2] != k.shape[:2] or self.k.shape[-1] != k.shape[-1]):
            raise ValueError(f"KV cache holds (B, H, T, D) = {tuple(self.k.shape)}, "
                             f"new keys are {tuple(k.shape)}")
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        return self.k, self.v

    def reset(self) -> None:
        self.k = self.v = None


@dataclass
class _Masking:
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


def _math_attention(q, k, v, bias, row_ok, dropout_p: float, need_weights: bool):
    """Reference softmax attention. q: (B, H, N, D), k/v: (B, H, M, D); bias broadcastable to (B, H, N, M)."""
    scores = torch.einsum("bhnd,bhmd->bhnm", q * q.shape[-1] ** -0.5, k)
    if bias is not None:
        scores = scores.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else scores + bias
    weights = scores.softmax(dim=-1, dtype=torch.float32)
    if row_ok is not None:
        weights = weights * row_ok
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = torch.einsum("bhnm,bhmd->bhnd", dropped.to(v.dtype), v)
    return out, (weights if need_weights else None)


def _sdpa_attention(q, k, v, bias, row_ok, dropout_p: float, is_causal: bool):
    if bias is not None and bias.dtype != torch.bool:
        bias = bias.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=is_causal)
    return out if row_ok is None else out * row_ok


def _elu_feature(t: torch.Tensor) -> torch.Tensor:
    return F.elu(t) + 1.0


def _divide_or_zero(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where den == 0 (every key masked); finite gradients there too, unlike a clamp,
    whose backward divides by tiny**2 == 0."""
    return num / den.masked_fill(den == 0, 1.0)


def _linear_attention(q, k, v, masking: _Masking, need_weights: bool):
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


def _check_rank3(name: str, t, width: int, width_name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of shape (B, N, {width_name}={width}), "
                         f"got {type(t).__name__}")
    if t.dim() != 3 or t.shape[-1] != width:
        raise ValueError(f"{name} must have shape (B, N, {width_name}={width}), got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _check_mask(mask, b: int, h: int, n: int, m: int, device) -> torch.Tensor:
    expected = ("a bool (True = may attend) or float (added) tensor broadcastable to "
                f"(B, H, N, M) = {(b, h, n, m)}")
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"mask must be {expected}, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"mask must be {expected}, got dtype {mask.dtype}")
    full = (b, h, n, m)
    if not 2 <= mask.dim() <= 4 or any(s not in (1, t) for s, t in zip(mask.shape, full[-mask.dim():],
                                                                         strict=True)):
        raise ValueError(f"mask must be {expected}, got shape {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but the input is on {device}; "
                         "move it with mask.to(x.device)")
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


class MultiHeadAttention(nn.Module):
    """Multi-head (self- or cross-) attention over tokens (B, N, dim).

    Args:
        dim: token width; must be divisible by ``num_heads``.
        num_heads: number of heads; head_dim = dim // num_heads.
        context_dim: width of the context for cross-attention. None: the module has one fused
            ``qkv = Linear(dim, 3 * dim)`` laid out as (3, heads, head_dim), as timm's ``Attention.qkv`` and
            ``nn.MultiheadAttention.in_proj_weight``; it still accepts a context of width ``dim``.
            Given: ``q = Linear(dim, dim)`` and ``kv = Linear(context_dim, 2 * dim)`` laid out as
            (2, heads, head_dim).
        qkv_bias: bias on the input projections.
        attn_drop, proj_drop: dropout on the attention probabilities and on the output.
        backend: "auto" | "sdpa" | "math" | "chunked" | "linear". Public attribute, read at every forward.
        rel_pos_grid: (gh, gw) turns on a learned 2D relative position bias over the last gh * gw tokens.
        num_prefix_tokens: leading tokens (class token) that get no relative bias.
        chunk_size: query rows per chunk for the chunked backend.
    """

    def __init__(self, dim: int, num_heads: int = 8, *, context_dim: int | None = None, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, backend: str = "auto",
                 rel_pos_grid: tuple[int, int] | None = None, num_prefix_tokens: int = 0,
                 chunk_size: int = 256):
        super().__init__()
        if num_heads < 1 or dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.context_dim = context_dim
        self.backend = backend
        self.chunk_size = chunk_size
        self.attn_drop = attn_drop
        if context_dim is None:
            self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        else:
            self.q = nn.Linear(dim, dim, bias=qkv_bias)
            self.kv = nn.Linear(context_dim, 2 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.rel_pos_bias = (RelativePositionBias2D(num_heads, rel_pos_grid, num_prefix_tokens)
                             if rel_pos_grid is not None else None)
        self.weights_hook = None  # set by zoo.record_attention: called with (B, H, N, M) weights

    def resolved_backend(self, need_weights: bool = False) -> str:
        """The backend a forward would run: "auto" follows zoo.set_backend; weights come from math
        unless the chosen backend computes them itself (math, chunked, linear)."""
        backend = _auto_backend if self.backend == "auto" else self.backend
        if backend not in BACKENDS[1:]:
            raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS[1:]}")
        return "math" if need_weights and backend == "sdpa" else backend

    def _project(self, x: torch.Tensor, context: torch.Tensor | None):
        """q: (B, H, N, D); k, v: (B, H, M, D)."""
        if context is None:
            q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.num_heads)
            return q, k, v
        if self.context_dim is None:  # cross-attention through the fused weights, as nn.MultiheadAttention
            sizes = [self.dim, 2 * self.dim]
            w_q, w_kv = self.qkv.weight.split(sizes)
            b_q, b_kv = (None, None) if self.qkv.bias is None else self.qkv.bias.split(sizes)
            q, kv = F.linear(x, w_q, b_q), F.linear(context, w_kv, b_kv)
        else:
            q, kv = self.q(x), self.kv(context)
        q = rearrange(q, "b n (h d) -> b h n d", h=self.num_heads)
        k, v = rearrange(kv, "b m (two h d) -> two b h m d", two=2, h=self.num_heads)
        return q, k, v

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *,
                mask: torch.Tensor | None = None, is_causal: bool = False, need_weights: bool = False,
                kv_cache: KVCache | None = None):
        """x: (B, N, dim); context: (B, M, context_dim or dim) or None (self-attention).
        mask: bool (True = may attend) or float (added), broadcastable to (B, H, N, M).
        is_causal: query i sees keys j <= i + M - N (bottom-right aligned when a KV cache makes M > N).
        Returns out (B, N, dim), or (out, weights (B, H, N, M)) with need_weights."""
        _check_rank3("x", x, self.dim, "dim")
        if context is not None:
            _check_rank3("context", context, self.context_dim or self.dim, "context_dim")
            if context.shape[0] != x.shape[0]:
                raise ValueError(f"context batch {context.shape[0]} != x batch {x.shape[0]}")
            if kv_cache is not None:
                raise ValueError("kv_cache is for causal self-attention; pass no context with it")
        elif self.context_dim is not None:
            raise ValueError(f"this module was built for cross-attention (context_dim={self.context_dim}): "
                             "pass a context")
        q, k, v = self._project(x, context)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
        b, h, n, _ = q.shape
        m = k.shape[-2]
        if mask is not None:
            mask = _check_mask(mask, b, h, n, m, x.device)
        rel_bias = None
        if self.rel_pos_bias is not None:
            if not n == m == self.rel_pos_bias.num_tokens:
                raise ValueError(f"relative position bias over grid {self.rel_pos_bias.grid} with "
                                 f"{self.rel_pos_bias.num_prefix_tokens} prefix tokens needs N == M == "
                                 f"{self.rel_pos_bias.num_tokens} tokens, got N={n}, M={m}")
            rel_bias = self.rel_pos_bias()
        masking = _Masking(mask, is_causal, rel_bias, n, m)
        want_weights = need_weights or self.weights_hook is not None
        out, weights = self._attend(q, k, v, masking, want_weights)
        if self.weights_hook is not None:
            self.weights_hook(weights)
        out = self.proj_drop(self.proj(rearrange(out, "b h n d -> b n (h d)")))
        return (out, weights) if need_weights else out

    def _attend(self, q, k, v, masking: _Masking, need_weights: bool):
        backend = self.resolved_backend(need_weights)
        dropout_p = self.attn_drop if self.training else 0.0
        if backend == "linear":
            return _linear_attention(q, k, v, masking, need_weights)
        if backend == "sdpa":
            only_causal = masking.causal and masking.mask is None and masking.rel_bias is None
            if only_causal and masking.n == masking.m:  # torch's is_causal is top-left aligned when N != M
                return _sdpa_attention(q, k, v, None, None, dropout_p, is_causal=True), None
            bias, row_ok = masking.bias(slice(None), q.dtype, q.device)
            return _sdpa_attention(q, k, v, bias, row_ok, dropout_p, is_causal=False), None
        if backend == "math":
            bias, row_ok = masking.bias(slice(None), q.dtype, q.device)
            return _math_attention(q, k, v, bias, row_ok, dropout_p, need_weights)
        return self._chunked(q, k, v, masking, dropout_p, need_weights)

    def _chunked(self, q, k, v, masking: _Masking, dropout_p: float, need_weights: bool):
        recompute = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        outs, weights = [], []
        for start in range(0, masking.n, self.chunk_size):
            rows = slice(start, start + self.chunk_size)

            def chunk(q_rows, k, v, rows=rows):
                bias, row_ok = masking.bias(rows, q_rows.dtype, q_rows.device)
                return _math_attention(q_rows, k, v, bias, row_ok, dropout_p, need_weights)

            if recompute and not need_weights:
                out, w = checkpoint(chunk, q[:, :, rows], k, v, use_reentrant=False)
            else:
                out, w = chunk(q[:, :, rows], k, v)
            outs.append(out)
            weights.append(w)
        return torch.cat(outs, dim=2), (torch.cat(weights, dim=2) if need_weights else None)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, backend={self.backend!r}"
