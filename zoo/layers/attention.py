"""Multi-head attention, the block every model in the zoo is made of (Vaswani et al. 2017,
https://arxiv.org/abs/1706.03762).

One module, several interchangeable backends that compute the same function:

- ``sdpa``: ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where torch has them);
- ``math``: explicit scores and softmax, the reference, and the one that returns weights;
- ``chunked``: queries in chunks of ``chunk_size``, never more than chunk x M scores alive; in training
  each chunk is recomputed in backward (activation checkpointing), so memory stays linear in N there too;
  with a windowed ``zoo.masks.spec`` it is *banded*: each chunk reads only the keys its window reaches;
- ``linear``: kernel attention with the elu+1 feature map (Katharopoulos et al. 2020,
  https://arxiv.org/abs/2006.16236), linear in N. An *approximation*: it does not equal softmax attention;
- ``flex``: ``torch.nn.attention.flex_attention`` with a cached block mask from a ``zoo.masks.spec``
  (``zoo.layers.flex``): masked blocks are skipped. Forward only on the CPU (no backward there in torch 2.14).

Masks follow ``F.scaled_dot_product_attention``: bool means True = may attend, float is added to the scores;
either broadcasts to (B, H, N, M). Or a ``zoo.masks.spec(causal, window, lengths)``, which every backend
takes (dense ones materialise it block by block). A query that may attend no key gets attention output 0 (so
the module returns ``proj.bias``, as ``torch.nn.MultiheadAttention`` does), never NaN.

"auto" means what the enclosing ``attention_backend`` block says ("sdpa" outside any); when that is "sdpa"
and the mask is a spec with a window, ``backends.auto_sparse`` picks the path that skips masked work by a
fixed rule on (device, N, window, dropout): flex on CUDA, the banded chunked path on the CPU.

``torch.fx`` symbolic tracing works for self- and cross-attention without a mask (or with a ``zoo.masks.spec``
fixed in the calling module, traced as its dense mask), with or without relative bias, on the sdpa and math
backends (``rearrange`` is a leaf function of the graph; input checks step aside while tracing; traced on its
own, the module needs its keyword options as ``concrete_args``); ``torch.export`` and ``torch.compile`` work
with every option (a spec is a constant of an exported graph; flex's block mask is built behind a graph break).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.fx
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .backends import Masking, attend, auto_sparse
from .checks import check_dtype, check_flag, check_int, check_rate, tracing
from .masks import MaskSpec
from .position import RelativePositionBias2D

torch.fx.wrap("rearrange")  # einops cannot take an fx Proxy: the call becomes one node of the graph

BACKENDS = ("auto", "sdpa", "math", "chunked", "linear", "flex")
_AUTO = ContextVar("zoo_attention_auto_backend", default="sdpa")


def _check_backend(name, allowed=BACKENDS[1:]) -> str:
    if name not in allowed:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {allowed}")
    return name


@contextmanager
def attention_backend(name: str):
    """Run a block of code with ``backend="auto"`` meaning ``name`` (any backend but "auto")::

        with zoo.attention_backend("chunked"):
            model(images)   # every MultiHeadAttention built with backend="auto" runs chunked here

    Modules built with an explicit backend keep it. The setting is a ``contextvars.ContextVar``: it holds in
    the block only, in the thread (or asyncio task) that entered it; it is restored on exit, also when the block
    raises, and blocks nest. Other threads are not affected, and a thread started inside the block begins
    from the default "sdpa" (Python gives a new thread an empty context unless
    ``sys.flags.thread_inherit_context``): enter the block in the thread that runs the model.
    ``torch.compile`` reads the setting when it traces and guards on it, so a compiled model recompiles
    when it runs under another setting; ``torch.export`` records the backend in effect when it traces."""
    token = _AUTO.set(_check_backend(name))
    try:
        yield name
    finally:
        _AUTO.reset(token)


def set_backend(name: str) -> str:
    """Make ``backend="auto"`` mean ``name`` from now on in the current context and return what it meant
    before. A thin wrapper kept for old scripts: it sets the ``attention_backend`` ContextVar without a block,
    so it holds for the rest of the calling thread (other threads never see it) until set again, and an
    enclosing ``attention_backend`` block undoes it on exit. Prefer the context manager, which restores the
    old value by itself."""
    old = _AUTO.get()
    _AUTO.set(_check_backend(name))
    return old


def get_backend() -> str:
    """What ``backend="auto"`` currently means (``"sdpa"`` unless an ``attention_backend`` block says else)."""
    return _AUTO.get()


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


def _check_rank3(name: str, t, width: int, width_name: str) -> None:
    if tracing():
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of shape (B, N, {width_name}={width}), "
                         f"got {type(t).__name__}")
    if t.dim() != 3 or t.shape[-1] != width:
        raise ValueError(f"{name} must have shape (B, N, {width_name}={width}), got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _check_spec(spec: MaskSpec, b: int, n: int, m: int) -> MaskSpec:
    if spec.grid is not None and not tracing() and not n == m == spec.grid[0] * spec.grid[1]:
        raise ValueError(f"mask spec over grid {spec.grid} needs N == M == {spec.grid[0] * spec.grid[1]} tokens, "
                         f"got N={n}, M={m}")
    if spec.lengths is not None and not tracing():
        if len(spec.lengths) != b:
            raise ValueError(f"mask spec has {len(spec.lengths)} lengths, expected one per batch element (B={b})")
        if max(spec.lengths) > m:
            raise ValueError(f"mask spec lengths must lie in [0, M={m}], got {list(spec.lengths)}")
    return spec


def _check_mask(mask, b: int, h: int, n: int, m: int, device) -> torch.Tensor:
    expected = ("a bool (True = may attend) or float (added) tensor broadcastable to "
                f"(B, H, N, M) = {(b, h, n, m)}, or a zoo.masks.spec")
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"mask must be {expected}, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"mask must be {expected}, got dtype {mask.dtype}")
    full = (b, h, n, m)
    if mask.dim() == 2 and mask.shape[0] == b != n and b > 1:
        raise ValueError(f"mask of shape {tuple(mask.shape)} looks like a (B, M) key-padding mask; a 2-D mask is "
                         f"read as (N, M) = {(n, m)}: pass key padding as (B, 1, 1, M) (zoo.masks.padding_mask)")
    if mask.dim() == 2 and b == n > 1:
        raise ValueError(f"a 2-D mask is ambiguous when B == N == {n}: it could be (N, M) per query or a (B, M) "
                         "key-padding mask; pass (1, 1, N, M) for a per-query mask or (B, 1, 1, M) for key padding")
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
        dim: token width, a positive int divisible by ``num_heads``.
        num_heads: number of heads (a positive int); head_dim = dim // num_heads.
        context_dim: width of the context for cross-attention. None: the module has one fused
            ``qkv = Linear(dim, 3 * dim)`` laid out as (3, heads, head_dim), as timm's ``Attention.qkv`` and
            ``nn.MultiheadAttention.in_proj_weight``; it still accepts a context of width ``dim``.
            Given: ``q = Linear(dim, dim)`` and ``kv = Linear(context_dim, 2 * dim)`` laid out as
            (2, heads, head_dim).
        qkv_bias: bias on the input projections.
        attn_drop, proj_drop: dropout on the attention probabilities and on the output, each in [0, 1).
        backend: "auto" | "sdpa" | "math" | "chunked" | "linear" | "flex". Public attribute, read at every
            forward; "auto" means what the enclosing ``attention_backend`` block says ("sdpa" outside any), and
            with a windowed mask spec the sparse path of ``backends.auto_sparse`` where that is "sdpa".
        rel_pos_grid: (gh, gw) turns on a learned 2D relative position bias over the last gh * gw tokens.
        num_prefix_tokens: leading tokens (class token) that get no relative bias; an int >= 0.
        chunk_size: query rows per chunk for the chunked backend, a positive int.

    A wrong argument raises ``ValueError`` here, naming it with what was expected and what was given.
    """

    def __init__(self, dim: int, num_heads: int = 8, *, context_dim: int | None = None, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, backend: str = "auto",
                 rel_pos_grid: tuple[int, int] | None = None, num_prefix_tokens: int = 0,
                 chunk_size: int = 256):
        super().__init__()
        dim, num_heads = check_int("dim", dim), check_int("num_heads", num_heads)
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        if context_dim is not None:
            context_dim = check_int("context_dim", context_dim)
        num_prefix_tokens = check_int("num_prefix_tokens", num_prefix_tokens, minimum=0)
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.context_dim = context_dim
        self.backend = _check_backend(backend, BACKENDS)
        self.chunk_size = check_int("chunk_size", chunk_size)
        self.attn_drop = check_rate("attn_drop", attn_drop)
        if context_dim is None:
            self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        else:
            self.q = nn.Linear(dim, dim, bias=qkv_bias)
            self.kv = nn.Linear(context_dim, 2 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(check_rate("proj_drop", proj_drop))
        self.rel_pos_bias = (RelativePositionBias2D(num_heads, rel_pos_grid, num_prefix_tokens)
                             if rel_pos_grid is not None else None)
        self.weights_hook = None  # set by zoo.record_attention: called with (B, H, N, M) weights

    def resolved_backend(self, need_weights: bool = False, mask=None, x: torch.Tensor | None = None) -> str:
        """The backend a forward of ``x`` with ``mask`` would run: "auto" follows ``attention_backend``, and
        with a windowed spec where that says "sdpa", ``auto_sparse``'s rule; weights come from math unless the
        chosen backend computes them itself (math, chunked, linear)."""
        backend = _check_backend(_AUTO.get() if self.backend == "auto" else self.backend)
        if self.backend == "auto" and backend == "sdpa" and isinstance(mask, MaskSpec) and mask.window is not None \
                and x is not None and not need_weights and not tracing():  # fx: the dense path, shapes unknown
            dropout_p = self.attn_drop if self.training else 0.0
            backend = auto_sparse(x.device, torch.is_grad_enabled(), x.shape[1], mask.reach, dropout_p) or backend
        return "math" if need_weights and backend in ("sdpa", "flex") else backend

    def _project(self, x: torch.Tensor, context: torch.Tensor | None):
        """q: (B, H, N, D); k, v: (B, H, M, D)."""
        if context is None:
            qkv = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.num_heads)
            return qkv.unbind(0)
        if self.context_dim is None:  # cross-attention through the fused weights, as nn.MultiheadAttention
            sizes = [self.dim, 2 * self.dim]
            w_q, w_kv = self.qkv.weight.split(sizes)
            b_q, b_kv = (None, None) if self.qkv.bias is None else self.qkv.bias.split(sizes)
            q, kv = F.linear(x, w_q, b_q), F.linear(context, w_kv, b_kv)
        else:
            q, kv = self.q(x), self.kv(context)
        q = rearrange(q, "b n (h d) -> b h n d", h=self.num_heads)
        k, v = rearrange(kv, "b m (two h d) -> two b h m d", two=2, h=self.num_heads).unbind(0)
        return q, k, v

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *,
                mask: torch.Tensor | None = None, is_causal: bool = False, need_weights: bool = False,
                kv_cache: KVCache | None = None):
        """x: (B, N, dim); context: (B, M, context_dim or dim) or None (self-attention).
        mask: bool (True = may attend) or float (added), broadcastable to (B, H, N, M); a 2-D mask is (N, M),
            refused when B == N > 1 (it could be a (B, M) key-padding mask): pass 4-D masks there. Or a
            ``zoo.masks.spec`` (lengths: one per batch element, at most M), which every backend accepts.
        is_causal: query i sees keys j <= i + M - N (bottom-right aligned when a KV cache makes M > N).
        Returns out (B, N, dim), or (out, weights (B, H, N, M)) with need_weights."""
        self._check_inputs(x, context, kv_cache, is_causal=is_causal, need_weights=need_weights)
        q, k, v = self._project(x, context)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
        n, m = q.shape[-2], k.shape[-2]
        spec = _check_spec(mask, q.shape[0], n, m) if isinstance(mask, MaskSpec) else None
        if mask is not None and spec is None:
            mask = _check_mask(mask, q.shape[0], q.shape[1], n, m, x.device)
        masking = Masking(mask if spec is None else None, is_causal, self._rel_bias(n, m), n, m, spec)
        want_weights = need_weights or self.weights_hook is not None
        backend = self.resolved_backend(want_weights, mask, x)
        out, weights = self._attend(backend, q, k, v, masking, want_weights)
        if self.weights_hook is not None:
            self.weights_hook(weights)
        out = self.proj_drop(self.proj(rearrange(out, "b h n d -> b n (h d)")))
        return (out, weights) if need_weights else out

    def _check_inputs(self, x, context, kv_cache, *, is_causal, need_weights) -> None:
        if tracing():
            return
        check_flag("is_causal", is_causal)
        check_flag("need_weights", need_weights)
        _check_rank3("x", x, self.dim, "dim")
        check_dtype("x", x, self.proj.weight.dtype)
        if context is not None:
            _check_rank3("context", context, self.context_dim or self.dim, "context_dim")
            check_dtype("context", context, self.proj.weight.dtype)
            if context.shape[0] != x.shape[0]:
                raise ValueError(f"context batch {context.shape[0]} != x batch {x.shape[0]}")
            if kv_cache is not None:
                raise ValueError("kv_cache is for causal self-attention; pass no context with it")
        elif self.context_dim is not None:
            raise ValueError(f"this module was built for cross-attention (context_dim={self.context_dim}): "
                             "pass a context")

    def _rel_bias(self, n: int, m: int) -> torch.Tensor | None:
        """(H, N, M) relative position bias, or None without one."""
        if self.rel_pos_bias is None:
            return None
        if not tracing() and not n == m == self.rel_pos_bias.num_tokens:
            raise ValueError(f"relative position bias over grid {self.rel_pos_bias.grid} with "
                             f"{self.rel_pos_bias.num_prefix_tokens} prefix tokens needs N == M == "
                             f"{self.rel_pos_bias.num_tokens} tokens, got N={n}, M={m}")
        return self.rel_pos_bias()

    def _attend(self, backend: str, q, k, v, masking: Masking, need_weights: bool):
        dropout_p = self.attn_drop if self.training else 0.0
        return attend(backend, q, k, v, masking, dropout_p, need_weights, self.chunk_size)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, backend={self.backend!r}"
