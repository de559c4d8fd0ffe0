"""PatchWhitening: after ``fit``, the layer's outputs on the images it was fitted on are decorrelated with unit
variance (checked on the covariance of its output channels, computed independently of its filters), the
filter is a buffer (not a parameter) saved in the state_dict, and bad input is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zoo.layers.whitening import PatchWhitening


def correlated_images(n: int = 512) -> torch.Tensor:
    """Smooth, channel-correlated images: neighbouring pixels and the three channels share signal."""
    base = F.avg_pool2d(torch.randn(n, 1, 18, 18), 3, stride=1)  # (n, 1, 16, 16), spatially smooth
    return torch.cat([base, 0.8 * base + 0.2 * torch.randn_like(base), 0.3 * torch.randn_like(base) - base], dim=1)


def test_fitted_outputs_are_white():
    images = correlated_images()
    layer = PatchWhitening(3, kernel_size=2, eps=1e-6)
    layer.fit(images)
    with torch.no_grad():
        out = layer(images)[:, : layer.out_chans // 2]  # the positive half; the other half is its negation
    flat = out.permute(0, 2, 3, 1).reshape(-1, out.shape[1]).double()
    cov = torch.cov(flat.T)
    assert torch.allclose(cov, torch.eye(len(cov), dtype=cov.dtype), atol=2e-2)


def test_filters_come_in_signed_pairs_and_are_not_parameters():
    layer = PatchWhitening(3, kernel_size=2)
    half = layer.out_chans // 2
    assert torch.equal(layer.weight[half:], -layer.weight[:half])
    assert [name for name, _ in layer.named_parameters()] == ["bias"]
    assert "weight" in layer.state_dict()
    before = layer.weight.clone()
    layer.fit(correlated_images(64))
    assert not torch.equal(layer.weight, before)


def test_output_shape_and_conv_equivalence():
    layer = PatchWhitening(3, kernel_size=2)
    x = torch.randn(2, 3, 8, 8)
    expected = F.conv2d(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), expected) and layer(x).shape == (2, 24, 7, 7)


@pytest.mark.parametrize("bad, match", [
    (torch.randn(4, 1, 8, 8), r"fit expects float images \(N, 3, H, W\)"),
    (torch.zeros(4, 3, 8, 8, dtype=torch.uint8), r"fit expects float images"),
])
def test_fit_refuses_bad_images(bad, match):
    with pytest.raises(ValueError, match=match):
        PatchWhitening(3).fit(bad)


def test_constructor_checks():
    with pytest.raises(ValueError, match="in_chans must be a positive int"):
        PatchWhitening(0)
    with pytest.raises(ValueError, match="kernel_size must be a positive int"):
        PatchWhitening(3, kernel_size=0)
