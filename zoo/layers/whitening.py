"""Patch whitening, the first layer of airbench (Jordan 2024, https://arxiv.org/abs/2404.00498; after Coates &
Ng 2011): a k x k conv whose filters are the eigenvectors of the covariance of the training images' k x k
patches, scaled by 1 / sqrt(eigenvalue + eps), each used with both signs. Its output channels are decorrelated
with unit variance from the first step, which is what lets a small conv net learn fast.

The filter is computed from data, not learned: it is a buffer (saved in the state_dict, never given to the
optimiser), so every parameter of a model that uses it still receives a gradient. The bias is a parameter.
Until ``fit`` is called the filter is a fixed random orthogonal projection, so an unfitted layer is usable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PatchWhitening(nn.Module):
    """k x k stride-1 conv, no padding, with frozen whitening filters: (B, in_chans, H, W) ->
    (B, 2 * num_filters, H - k + 1, W - k + 1).

    Args:
        in_chans: input channels.
        kernel_size: patch side k.
        num_filters: whitening filters kept (each used with both signs); default ``in_chans * k * k``, the
            patch dimension. Fewer keeps the leading eigenvectors; more pads with zero filters. Fixing it lets
            a model keep its width when ``in_chans`` changes (timm adapts pretrained first convs that way).
        eps: added to the eigenvalues before the inverse square root (images in normalised units).
    """

    def __init__(self, in_chans: int = 3, kernel_size: int = 2, num_filters: int | None = None,
                 eps: float = 5e-4):
        super().__init__()
        if not isinstance(in_chans, int) or in_chans < 1:
            raise ValueError(f"in_chans must be a positive int, got {in_chans!r}")
        if not isinstance(kernel_size, int) or kernel_size < 1:
            raise ValueError(f"kernel_size must be a positive int, got {kernel_size!r}")
        dim = in_chans * kernel_size * kernel_size
        num_filters = dim if num_filters is None else num_filters
        if not isinstance(num_filters, int) or num_filters < 1:
            raise ValueError(f"num_filters must be a positive int, got {num_filters!r}")
        self.in_chans, self.kernel_size, self.num_filters, self.eps = in_chans, kernel_size, num_filters, eps
        self.out_chans = 2 * num_filters
        basis = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(0)))[0]
        self.register_buffer("weight", self._signed(basis.T))
        self.bias = nn.Parameter(torch.zeros(self.out_chans))

    def _signed(self, filters: torch.Tensor) -> torch.Tensor:
        """(dim, dim) rows of filters, leading first -> (2 * num_filters, in_chans, k, k): the first
        ``num_filters`` (zero rows added when there are fewer) and their negations."""
        k = self.kernel_size
        filters = F.pad(filters[:self.num_filters], (0, 0, 0, max(self.num_filters - len(filters), 0)))
        filters = filters.reshape(-1, self.in_chans, k, k)
        return torch.cat([filters, -filters])

    @torch.no_grad()
    def fit(self, images: torch.Tensor, max_images: int = 5000) -> None:
        """Set the filters from (N, in_chans, H, W) float images (normalised as the model will see them):
        eigen-decompose the covariance of every k x k patch of the first ``max_images`` images."""
        if images.dim() != 4 or images.shape[1] != self.in_chans or not images.is_floating_point():
            raise ValueError(f"fit expects float images (N, {self.in_chans}, H, W), got "
                             f"{tuple(images.shape)} {images.dtype}")
        x = images[:max_images].to(torch.float64)
        patches = F.unfold(x, self.kernel_size).transpose(1, 2).flatten(0, 1)  # (P, dim)
        patches = patches - patches.mean(dim=0)
        cov = patches.T @ patches / len(patches)
        eigenvalues, eigenvectors = torch.linalg.eigh(cov)
        filters = eigenvectors.T / (eigenvalues[:, None] + self.eps).sqrt()
        self.weight.copy_(self._signed(filters.flip(0)).to(self.weight))  # largest eigenvalue first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_chans}, {self.out_chans}, kernel_size={self.kernel_size}"
