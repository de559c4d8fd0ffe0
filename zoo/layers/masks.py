"""Boolean attention-mask builders and ``MaskSpec``, the one mask description every backend accepts.
Convention everywhere in the zoo: **True = may attend** (the ``F.scaled_dot_product_attention`` convention;
``torch.nn.MultiheadAttention`` uses the opposite).

``spec(causal=False, window=None, lengths=None)`` says *which* keys a query may see without building the
(N, M) matrix: dense backends materialise it row block by row block (``MaskSpec.dense``), the chunked backend
visits only the keys a window can reach (``MaskSpec.key_range``), and "flex" turns ``MaskSpec.mask_mod`` into
a cached block mask. With M keys and N queries (M > N with a KV cache) the diagonal is aligned bottom-right,
as for ``causal_mask``: query i sits at key position i + M - N."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .checks import check_grid


def causal_mask(n: int, m: int | None = None, *, rows: slice | None = None, device=None) -> torch.Tensor:
    """(n, m) bool, True on and below the diagonal. With m > n (a KV cache) the diagonal is aligned
    bottom-right: query i may attend key j when j <= i + m - n. ``rows`` (a slice of the n queries) builds
    only those rows, (len(rows), m), so a chunked caller never holds all n x m."""
    m = n if m is None else m
    query = torch.arange(n, device=device)[rows if rows is not None else slice(None)]
    return torch.arange(m, device=device)[None, :] <= query[:, None] + (m - n)


def _check_lengths(lengths, n: int | None) -> torch.Tensor:
    """``lengths`` as a 1-D integer tensor with values in [0, n] (n None: any value >= 0)."""
    lengths = torch.as_tensor(lengths)
    if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
        raise ValueError(f"lengths must be integers (a list of ints or an integer tensor), got {lengths.tolist()} "
                         f"of dtype {lengths.dtype}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (one length per sequence), got shape {tuple(lengths.shape)}")
    if bool((lengths < 0).any()) or (n is not None and bool((lengths > n).any())):
        raise ValueError(f"lengths must lie in [0, {'inf' if n is None else n}], got {lengths.tolist()}")
    return lengths


def padding_mask(lengths: torch.Tensor | list[int], n: int) -> torch.Tensor:
    """(B, 1, 1, n) bool, True for the first ``lengths[b]`` (real) tokens of each sequence; ``lengths`` holds
    integers in [0, n] (a list of ints or an integer tensor)."""
    lengths = _check_lengths(lengths, n)
    positions = torch.arange(n, device=lengths.device)
    return (positions[None, :] < lengths[:, None])[:, None, None, :]


def sliding_window_mask(n: int, window: int, *, device=None) -> torch.Tensor:
    """(n, n) bool, True where |i - j| <= window (local attention)."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    idx = torch.arange(n, device=device)
    return (idx[:, None] - idx[None, :]).abs() <= window


def _near(query, key, window, gw: int | None):
    """Whether key positions are within ``window`` of query positions: 1D, or 2D on a grid ``gw`` wide."""
    if gw is None:
        return (query - key).abs() <= window
    return ((query // gw - key // gw).abs() <= window) & ((query % gw - key % gw).abs() <= window)


@dataclass(frozen=True)
class MaskSpec:
    """Which keys each query may attend, as rules rather than a tensor (build it with ``spec``). Immutable
    and hashable, so a backend can cache what it derives from it per (spec, shape, device).

    causal: key j only if j <= i + M - N. window: only keys with |i + M - N - j| <= window (None: no limit).
    lengths: per batch element b, only the first lengths[b] keys (key padding); None: every key.
    grid: (gh, gw): the N == M tokens are a row-major gh x gw grid and ``window`` is a 2D neighbourhood radius
    (neighbourhood attention, Hassani et al. 2022, https://arxiv.org/abs/2204.07143): key j only if its row
    and its column each differ from query i's by at most ``window``."""

    causal: bool = False
    window: int | None = None
    lengths: tuple[int, ...] | None = None
    grid: tuple[int, int] | None = None

    @property
    def reach(self) -> int | None:
        """The largest |i - j| (token positions, row-major on a grid) a window lets a query attend; None: any."""
        if self.window is None:
            return None
        if self.grid is None:
            return self.window
        gh, gw = self.grid
        return min(self.window, gh - 1) * gw + min(self.window, gw - 1)

    def dense(self, n: int, m: int | None = None, *, rows: slice = slice(None), cols: slice = slice(None),
              device=None) -> torch.Tensor:
        """(B or 1, 1, len(rows), len(cols)) bool, True = may attend; B = len(lengths). ``rows`` / ``cols``
        build only that block of the (n, m) mask, so chunked callers never hold all of it."""
        m = n if m is None else m
        query = torch.arange(n, device=device)[rows][:, None] + (m - n)  # the key position of each query
        key = torch.arange(m, device=device)[cols][None, :]
        allowed = torch.ones_like(query - key, dtype=torch.bool)  # (rows, cols); no sizes, so torch.fx traces it
        if self.causal:
            allowed = allowed & (key <= query)
        if self.window is not None:
            allowed = allowed & _near(query, key, self.window, None if self.grid is None else self.grid[1])
        if self.lengths is None:
            return allowed[None, None]
        lengths = torch.tensor(self.lengths, device=device)
        return allowed[None, None] & (key < lengths[:, None, None, None])

    def key_range(self, rows: slice, n: int, m: int | None = None) -> slice:
        """The smallest slice of the m keys holding every key that query rows ``rows`` (a slice with start and
        stop) may attend: what a window or causality can reach. Keys outside it are masked for these rows."""
        m = n if m is None else m
        first, last = rows.start + m - n, min(rows.stop, n) - 1 + m - n  # key positions of the first / last row
        if self.window is None:
            lo, hi = 0, m
        elif self.grid is None:
            lo, hi = max(0, first - self.window), last + self.window + 1
        else:  # whole grid rows, from window rows above the first query's to window rows below the last's
            gw = self.grid[1]
            lo, hi = max(0, (first // gw - self.window) * gw), (last // gw + self.window + 1) * gw
        hi = min(hi, last + 1) if self.causal else hi
        return slice(lo, max(lo, min(hi, m)))

    def row_ok(self, n: int, m: int | None = None, device=None) -> torch.Tensor:
        """(B or 1, 1, n, 1) bool: whether query row i may attend any key at all, computed from the rules in
        O(B * n) (the allowed keys of a row form one interval)."""
        m = n if m is None else m
        if self.grid is not None:  # no lengths with a grid (``spec`` refuses them): every query sees itself
            return torch.ones(1, 1, n, 1, dtype=torch.bool, device=device)
        query = torch.arange(n, device=device) + (m - n)
        lo, hi = torch.zeros_like(query), torch.full_like(query, m - 1)
        if self.window is not None:
            lo, hi = torch.maximum(lo, query - self.window), torch.minimum(hi, query + self.window)
        if self.causal:
            hi = torch.minimum(hi, query)
        hi = hi[None, :]
        if self.lengths is not None:
            hi = torch.minimum(hi, torch.tensor(self.lengths, device=device)[:, None] - 1)
        return (lo[None, :] <= hi)[:, None, :, None]

    def mask_mod(self, n: int, m: int | None = None, device=None):
        """The rule as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` for n queries, m keys."""
        m = n if m is None else m
        offset, causal, gw = m - n, self.causal, None if self.grid is None else self.grid[1]
        # window and lengths as tensors: a compiled flex kernel takes them as inputs instead of specialising on
        # their values, so another window or other lengths at the same shape reuse the compiled kernel
        window = None if self.window is None else torch.tensor(self.window, device=device)
        lengths = None if self.lengths is None else torch.tensor(self.lengths, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            query = q_idx + offset
            allowed = kv_idx >= 0
            if causal:
                allowed = allowed & (kv_idx <= query)
            if window is not None:
                allowed = allowed & _near(query, kv_idx, window, gw)
            if lengths is not None:
                allowed = allowed & (kv_idx < lengths[b])
            return allowed

        return mask_mod


if hasattr(torch.utils._pytree, "register_constant"):  # torch >= 2.7: torch.export takes a spec as a constant
    torch.utils._pytree.register_constant(MaskSpec)


def spec(causal: bool = False, window: int | None = None, lengths=None, grid=None) -> MaskSpec:
    """One mask description for every backend: ``attn(x, mask=zoo.masks.spec(causal=True, window=64,
    lengths=[n, 5]))``. ``causal``: a bool; ``window``: an int >= 0 (|i - j| <= window, as
    ``sliding_window_mask``) or None; ``lengths``: one int >= 0 per batch element (a list or a 1-D integer
    tensor), the number of real keys, or None; ``grid``: (gh, gw) to make ``window`` a 2D neighbourhood radius
    over a row-major token grid (needs a window, takes no lengths). Combined rules all hold (logical and)."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0):
        raise ValueError(f"window must be an int >= 0 or None, got {window!r}")
    if lengths is not None:
        lengths = tuple(int(v) for v in _check_lengths(lengths, None).tolist())
    if grid is not None:
        grid = check_grid("grid", grid)
        if window is None or lengths is not None:
            raise ValueError(f"a grid spec needs a window and takes no lengths, got window={window!r}, "
                             f"lengths={lengths!r}")
    return MaskSpec(causal, None if window is None else int(window), lengths, grid)
