"""zoo.masks against masks written out element by element (True = may attend)."""

from __future__ import annotations

import pytest
import torch

from zoo.masks import causal_mask, padding_mask, sliding_window_mask, spec


@pytest.mark.parametrize("n, m", [(1, 1), (4, 4), (3, 6), (5, 2)])
def test_causal_mask_is_bottom_right_aligned(n, m):
    expected = torch.tensor([[j <= i + m - n for j in range(m)] for i in range(n)])
    assert causal_mask(n, m).dtype == torch.bool
    torch.testing.assert_close(causal_mask(n, m), expected)
    if n == m:
        torch.testing.assert_close(causal_mask(n), torch.ones(n, n, dtype=torch.bool).tril())


@pytest.mark.parametrize("rows", [slice(0, 2), slice(2, 5), slice(4, None), slice(None)])
def test_causal_mask_rows_are_slices_of_the_full_mask(rows):
    torch.testing.assert_close(causal_mask(5, 7, rows=rows), causal_mask(5, 7)[rows])


def test_padding_mask_marks_real_tokens():
    mask = padding_mask([3, 0, 5], 5)
    assert mask.shape == (3, 1, 1, 5) and mask.dtype == torch.bool
    expected = torch.tensor([[j < length for j in range(5)] for length in (3, 0, 5)])
    torch.testing.assert_close(mask[:, 0, 0], expected)
    from_tensor = padding_mask(torch.tensor([2]), 3)
    torch.testing.assert_close(from_tensor[:, 0, 0], torch.tensor([[True, True, False]]))


@pytest.mark.parametrize("lengths, pattern", [
    ([6], r"\[0, 5\].*\[6\]"), ([-1], r"\[0, 5\].*\[-1\]"), ([[1, 2]], r"1-D.*\(1, 2\)"),
    ([2.0, 3.5], r"lengths must be integers.*\[2\.0, 3\.5\] of dtype torch\.float32"),
    (torch.tensor([2.0]), r"lengths must be integers.*\[2\.0\] of dtype torch\.float32"),
    ([True, False], r"lengths must be integers.*dtype torch\.bool"),
], ids=["too_long", "negative", "2d", "float_list", "float_tensor", "bool_list"])
def test_padding_mask_rejects_bad_lengths(lengths, pattern):
    with pytest.raises(ValueError, match=pattern):
        padding_mask(lengths, 5)


@pytest.mark.parametrize("n, w", [(6, 0), (6, 2), (4, 10)])
def test_sliding_window_mask(n, w):
    expected = torch.tensor([[abs(i - j) <= w for j in range(n)] for i in range(n)])
    torch.testing.assert_close(sliding_window_mask(n, w), expected)


def test_sliding_window_rejects_negative_window():
    with pytest.raises(ValueError, match=r">= 0, got -1"):
        sliding_window_mask(4, -1)


# ---------------------------------------------------------------- zoo.masks.spec against the dense builders


SPECS = [dict(), dict(causal=True), dict(window=0), dict(window=2), dict(causal=True, window=1),
         dict(lengths=[5, 0, 3]), dict(causal=True, window=2, lengths=[5, 0, 3])]


def _reference(kw: dict, n: int, m: int) -> torch.Tensor:
    """(B or 1, 1, n, m) from the dense builders, element by element where they do not reach (m != n)."""
    offset = m - n
    allowed = torch.ones(1, 1, n, m, dtype=torch.bool)
    if kw.get("causal"):
        allowed = allowed & causal_mask(n, m)
    if kw.get("window") is not None:
        w = kw["window"]
        band = sliding_window_mask(n, w) if n == m else torch.tensor(
            [[abs(i + offset - j) <= w for j in range(m)] for i in range(n)])
        allowed = allowed & band
    if kw.get("lengths") is not None:
        allowed = allowed & padding_mask(kw["lengths"], m)
    return allowed


@pytest.mark.parametrize("kw", SPECS, ids=str)
@pytest.mark.parametrize("n, m", [(5, 5), (3, 5)])
def test_spec_dense_equals_the_dense_masks(kw, n, m):
    s = spec(**kw)
    expected = _reference(kw, n, m)
    torch.testing.assert_close(s.dense(n, m), expected)
    torch.testing.assert_close(s.dense(n, m, rows=slice(1, 3), cols=slice(2, 4)), expected[..., 1:3, 2:4])
    torch.testing.assert_close(s.row_ok(n, m), expected.any(-1, keepdim=True))
    b = torch.arange(expected.shape[0])[:, None, None, None]
    q, kv = torch.arange(n)[None, None, :, None], torch.arange(m)[None, None, None, :]
    torch.testing.assert_close(s.mask_mod(n, m)(b, 0, q, kv).expand_as(expected), expected)


@pytest.mark.parametrize("kw", SPECS, ids=str)
@pytest.mark.parametrize("n, m", [(9, 9), (4, 9)])
@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_spec_key_range_holds_every_allowed_key(kw, n, m, chunk):
    s = spec(**kw)
    dense = s.dense(n, m).any(0)[0]  # (n, m): allowed for some batch element
    for start in range(0, n, chunk):
        cols = s.key_range(slice(start, start + chunk), n, m)
        outside = torch.ones(m, dtype=torch.bool)
        outside[cols] = False
        assert not dense[start:start + chunk, outside].any()
        if kw.get("window") is not None:  # the band: at most chunk + 2 * window keys
            assert cols.stop - cols.start <= chunk + 2 * kw["window"]


def test_spec_is_immutable_and_hashable():
    s = spec(causal=True, window=3, lengths=torch.tensor([4, 2]))
    assert s == spec(causal=True, window=3, lengths=[4, 2]) and hash(s) == hash(spec(True, 3, (4, 2)))
    assert s.lengths == (4, 2)
    with pytest.raises(AttributeError):
        s.window = 4


@pytest.mark.parametrize("kw, pattern", [
    (dict(causal=1), r"causal must be a bool, got 1"), (dict(window=-1), r"window must be an int >= 0.*-1"),
    (dict(window=2.0), r"window must be an int >= 0.*2\.0"), (dict(lengths=[2.5]), r"lengths must be integers"),
    (dict(lengths=[-1]), r"lengths must lie in \[0, inf\]"),
])
def test_spec_rejects_bad_arguments(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        spec(**kw)


def _grid_reference(gh: int, gw: int, w: int, causal: bool) -> torch.Tensor:
    """(1, 1, P, P), P = gh * gw, element by element: a 2D neighbourhood of radius w on the row-major grid."""
    cells = [(r, c) for r in range(gh) for c in range(gw)]
    return torch.tensor([[abs(qr - kr) <= w and abs(qc - kc) <= w and (not causal or j <= i)
                          for j, (kr, kc) in enumerate(cells)] for i, (qr, qc) in enumerate(cells)])[None, None]


@pytest.mark.parametrize("gh, gw, w", [(3, 4, 1), (4, 3, 0), (5, 5, 2), (2, 6, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_grid_spec_is_a_2d_neighbourhood(gh, gw, w, causal):
    s, p = spec(causal=causal, window=w, grid=(gh, gw)), gh * gw
    expected = _grid_reference(gh, gw, w, causal)
    torch.testing.assert_close(s.dense(p), expected)
    torch.testing.assert_close(s.row_ok(p), expected.any(-1, keepdim=True))
    q, kv = torch.arange(p)[None, None, :, None], torch.arange(p)[None, None, None, :]
    torch.testing.assert_close(s.mask_mod(p)(0, 0, q, kv), expected)
    assert s.reach == max(abs(i - j) for i, j in expected[0, 0].nonzero().tolist())
    for chunk in (1, 4, 5):
        for start in range(0, p, chunk):
            cols = s.key_range(slice(start, start + chunk), p)
            outside = torch.ones(p, dtype=torch.bool)
            outside[cols] = False
            assert not expected[0, 0, start:start + chunk, outside].any()


def test_grid_spec_needs_a_window_and_no_lengths():
    with pytest.raises(ValueError, match="grid spec needs a window and takes no lengths"):
        spec(grid=(2, 2))
    with pytest.raises(ValueError, match="grid spec needs a window and takes no lengths"):
        spec(window=1, grid=(2, 2), lengths=[4])
    with pytest.raises(ValueError, match=r"grid must be two positive ints"):
        spec(window=1, grid=(2, 0))
