"""CIFAR ResNets (He et al. 2016, https://arxiv.org/abs/1512.03385), with and without CBAM
(Woo et al. 2018, https://arxiv.org/abs/1807.06521).

The ImageNet stem (7x7 stride-2 conv + max-pool) would shrink a 32x32 image to 8x8 before the first
stage; the CIFAR variant has a 3x3 stride-1 conv and no pool, so the stages see 32, 16, 8 and 4 pixels.
Everything else is timm's ``ResNet`` (``timm.models.resnet``), so the model follows timm's conventions
as they are: ``num_classes=0`` gives pooled features, ``reset_classifier``, ``forward_features`` (B, C, H, W),
``forward_head(x, pre_logits=True)``, ``drop_path_rate``; the classifier is ``fc``. The CBAM variant is the
same network passed through ``zoo.add_cbam``.
"""

from __future__ import annotations

import torch
from timm.models.resnet import BasicBlock, ResNet
from torch import nn

from ..layers.cbam import add_cbam
from ..layers.checks import check_int, check_rate
from .inputs import check_images
from .registry import register_model

__all__ = ["CifarResNet", "resnet18", "resnet18_cbam"]


class CifarResNet(ResNet):
    """timm's ``ResNet`` with a CIFAR stem: ``conv1`` is a 3x3 stride-1 conv, ``maxpool`` is Identity.
    Takes timm's ResNet arguments (``block``, ``layers``, ``num_classes``, ``in_chans``, ``drop_path_rate``,
    ...); ``img_size`` is accepted for the zoo's common signature and ignored (any size works).
    Input (B, in_chans, H, W); logits (B, num_classes)."""

    def __init__(self, *args, in_chans: int = 3, img_size: int | None = None, **kwargs):
        for name in ("drop_rate", "drop_path_rate"):  # timm takes 2.0 (DropPath divides by 1 - rate)
            check_rate(name, kwargs.get(name, 0.0))
        super().__init__(*args, in_chans=check_int("in_chans", in_chans), **kwargs)
        self.in_chans = in_chans
        self.conv1 = nn.Conv2d(in_chans, self.conv1.out_channels, 3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(self.conv1.weight, mode="fan_out", nonlinearity="relu")  # as timm inits it
        self.maxpool = nn.Identity()
        for info in self.feature_info:  # the stem no longer downsamples by 4 (stride-2 conv, stride-2 pool)
            info["reduction"] = max(info["reduction"] // 4, 1)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_features, H / 8, W / 8)."""
        check_images(x, self.in_chans, dtype=self.conv1.weight.dtype)
        return super().forward_features(x)


@register_model(first_conv="conv1", classifier="fc", pool_size=(4, 4))
def resnet18(num_classes: int = 10, in_chans: int = 3, **kwargs) -> CifarResNet:
    """CIFAR ResNet-18: 3x3 stem, BasicBlock stages [2, 2, 2, 2] of width 64/128/256/512. 11.2M params."""
    return CifarResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, in_chans=in_chans, **kwargs)


@register_model(first_conv="conv1", classifier="fc", pool_size=(4, 4))
def resnet18_cbam(num_classes: int = 10, in_chans: int = 3, **kwargs) -> CifarResNet:
    """CIFAR ResNet-18 with a CBAM (reduction 16, 7x7 spatial conv) in every block, after ``bn2``."""
    return add_cbam(resnet18(num_classes=num_classes, in_chans=in_chans, **kwargs))
