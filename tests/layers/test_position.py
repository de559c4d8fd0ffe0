"""zoo.posembed: 2D sin-cos embedding against its formula written as a loop, relative position bias
against an explicit loop over patch pairs and timm's Swin index."""

from __future__ import annotations

import math

import pytest
import torch
from timm.models.swin_transformer import get_relative_position_index

from zoo.layers.position import RelativePositionBias2D, sincos_pos_embed_2d


def test_sincos_matches_formula():
    dim, (gh, gw), temperature = 8, (2, 3), 10000.0
    quarter = dim // 4
    expected = torch.zeros(gh * gw, dim)
    for y in range(gh):
        for x in range(gw):
            for k in range(quarter):
                omega = 1.0 / temperature ** (k / quarter)
                row = [math.sin(y * omega), math.cos(y * omega), math.sin(x * omega), math.cos(x * omega)]
                for part, value in enumerate(row):
                    expected[y * gw + x, part * quarter + k] = value
    torch.testing.assert_close(sincos_pos_embed_2d(dim, (gh, gw)), expected)


def test_sincos_rejects_dim_not_divisible_by_4():
    with pytest.raises(ValueError, match=r"divisible by 4, got 6"):
        sincos_pos_embed_2d(6, (2, 2))


def test_relative_bias_equals_loop_over_patch_pairs():
    gh, gw, heads, prefix = 2, 3, 2, 1
    rpb = RelativePositionBias2D(heads, (gh, gw), num_prefix_tokens=prefix)
    with torch.no_grad():
        rpb.relative_position_bias_table.copy_(torch.randn_like(rpb.relative_position_bias_table))
    table = rpb.relative_position_bias_table.detach()
    expected = torch.zeros(heads, prefix + gh * gw, prefix + gh * gw)
    for i in range(gh * gw):
        for j in range(gh * gw):
            dy, dx = i // gw - j // gw, i % gw - j % gw
            expected[:, prefix + i, prefix + j] = table[(dy + gh - 1) * (2 * gw - 1) + dx + gw - 1]
    bias = rpb()
    assert rpb.num_tokens == 7 and bias.shape == (heads, 7, 7)
    torch.testing.assert_close(bias, expected)
    assert bias[:, 0].abs().sum() == 0 and bias[:, :, 0].abs().sum() == 0  # class token: no bias


def test_relative_index_is_swin_layout():
    """Same table layout as timm's Swin, so its relative_position_bias_table loads as is."""
    rpb = RelativePositionBias2D(3, (3, 4))
    torch.testing.assert_close(rpb.relative_position_index, get_relative_position_index(3, 4))
    assert rpb.relative_position_bias_table.shape == ((2 * 3 - 1) * (2 * 4 - 1), 3)


@pytest.mark.parametrize("grid", [(0, 3), (2, -1), 8, (2,), (2.0, 3), None])
def test_relative_bias_rejects_bad_grid(grid):
    with pytest.raises(ValueError, match=r"two positive ints"):
        RelativePositionBias2D(2, grid)


def test_relative_bias_rejects_negative_prefix_tokens():
    with pytest.raises(ValueError, match=r"num_prefix_tokens must be an int >= 0, got -1"):
        RelativePositionBias2D(2, (2, 3), num_prefix_tokens=-1)
