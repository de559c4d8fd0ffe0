"""Boolean attention-mask builders. Convention everywhere in the zoo: **True = may attend**
(the ``F.scaled_dot_product_attention`` convention; ``torch.nn.MultiheadAttention`` uses the opposite)."""

from __future__ import annotations

import torch


def causal_mask(n: int, m: int | None = None, *, rows: slice | None = None, device=None) -> torch.Tensor:
    """(n, m) bool, True on and below the diagonal. With m > n (a KV cache) the diagonal is aligned
    bottom-right: query i may attend key j when j <= i + m - n. ``rows`` (a slice of the n queries) builds
    only those rows, (len(rows), m), so a chunked caller never holds all n x m."""
    m = n if m is None else m
    query = torch.arange(n, device=device)[rows if rows is not None else slice(None)]
    return torch.arange(m, device=device)[None, :] <= query[:, None] + (m - n)


def padding_mask(lengths: torch.Tensor | list[int], n: int) -> torch.Tensor:
    """(B, 1, 1, n) bool, True for the first ``lengths[b]`` (real) tokens of each sequence; ``lengths`` holds
    integers in [0, n] (a list of ints or an integer tensor)."""
    lengths = torch.as_tensor(lengths)
    if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
        raise ValueError(f"lengths must be integers (a list of ints or an integer tensor), got {lengths.tolist()} "
                         f"of dtype {lengths.dtype}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (one length per sequence), got shape {tuple(lengths.shape)}")
    if bool((lengths < 0).any()) or bool((lengths > n).any()):
        raise ValueError(f"lengths must lie in [0, {n}], got {lengths.tolist()}")
    positions = torch.arange(n, device=lengths.device)
    return (positions[None, :] < lengths[:, None])[:, None, None, :]


def sliding_window_mask(n: int, window: int, *, device=None) -> torch.Tensor:
    """(n, n) bool, True where |i - j| <= window (local attention)."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    idx = torch.arange(n, device=device)
    return (idx[:, None] - idx[None, :]).abs() <= window
