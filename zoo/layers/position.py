"""Position information for patch tokens: 2D sin-cos absolute embeddings (MAE, He et al. 2021,
https://arxiv.org/abs/2111.06377) and a learned 2D relative position bias (Swin, Liu et al. 2021,
https://arxiv.org/abs/2103.14030). Learned absolute embeddings are a plain ``nn.Parameter`` in the ViT;
resampling them to another grid is timm's ``resample_abs_pos_embed``."""

from __future__ import annotations

import torch
import torch.fx
from einops import rearrange
from torch import nn

from .checks import check_grid, check_int

torch.fx.wrap("rearrange")  # einops cannot take an fx Proxy: the call becomes one node of the graph


def sincos_pos_embed_2d(dim: int, grid: tuple[int, int], temperature: float = 10000.0) -> torch.Tensor:
    """(gh * gw, dim) fixed embedding: the first half of the channels encodes the row, the second
    the column, each as sin/cos of ``dim / 4`` frequencies. ``dim`` must be divisible by 4."""
    if dim % 4:
        raise ValueError(f"sin-cos position embedding needs dim divisible by 4, got {dim}")
    gh, gw = grid
    ys, xs = torch.meshgrid(torch.arange(gh, dtype=torch.float32), torch.arange(gw, dtype=torch.float32),
                            indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    angles_y = ys.flatten()[:, None] * omega[None, :]
    angles_x = xs.flatten()[:, None] * omega[None, :]
    return torch.cat([angles_y.sin(), angles_y.cos(), angles_x.sin(), angles_x.cos()], dim=1)


class RelativePositionBias2D(nn.Module):
    """Learned per-head bias indexed by the 2D offset between two patches of a (gh, gw) grid.

    Returns (heads, T, T) with T = num_prefix_tokens + gh * gw; rows and columns of prefix tokens
    (class token) are 0, so they get no bias.
    """

    def __init__(self, num_heads: int, grid: tuple[int, int], num_prefix_tokens: int = 0):
        super().__init__()
        gh, gw = check_grid("rel_pos_grid", grid)
        self.grid = (gh, gw)
        self.num_prefix_tokens = check_int("num_prefix_tokens", num_prefix_tokens, minimum=0)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * gh - 1) * (2 * gw - 1), num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")).flatten(1)
        offsets = coords[:, :, None] - coords[:, None, :]  # (2, P, P), offsets in [-(g-1), g-1]
        index = (offsets[0] + gh - 1) * (2 * gw - 1) + (offsets[1] + gw - 1)
        self.register_buffer("relative_position_index", index, persistent=False)

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.grid[0] * self.grid[1]

    def forward(self) -> torch.Tensor:
        bias = self.relative_position_bias_table[self.relative_position_index]  # (P, P, H)
        bias = rearrange(bias, "i j h -> h i j")
        p = self.num_prefix_tokens
        return nn.functional.pad(bias, (p, 0, p, 0))
