"""zoo.masks against masks written out element by element (True = may attend)."""

from __future__ import annotations

import pytest
import torch

from zoo.masks import causal_mask, padding_mask, sliding_window_mask


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
