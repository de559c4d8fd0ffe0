"""CIFAR ResNet-18 against torchvision's ResNet-18 with the CIFAR stem swapped in by hand (same parameter
names, so the same weights must give the same logits), and timm's model conventions."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
from torch import nn

import zoo


def torchvision_cifar_resnet18(num_classes: int = 10) -> nn.Module:
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def test_resnet18_equals_torchvision_with_a_cifar_stem():
    reference = torchvision_cifar_resnet18().eval()
    for m in reference.modules():  # non-trivial statistics, so eval-mode BN matters
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(std=0.1)
            m.running_var.uniform_(0.5, 1.5)
    model = zoo.create_model("resnet18").eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())


def test_resnet18_stem_keeps_full_resolution():
    model = zoo.create_model("resnet18")
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    assert model.forward_features(torch.randn(2, 3, 32, 32)).shape == (2, 512, 4, 4)


def test_timm_conventions():
    x = torch.randn(2, 3, 32, 32)
    model = zoo.create_model("resnet18", num_classes=0)
    assert model(x).shape == (2, 512)
    model.reset_classifier(5)
    assert model(x).shape == (2, 5)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 512)
    assert timm.create_model("zoo_resnet18", num_classes=7)(x).shape == (2, 7)
    assert timm.create_model("zoo_resnet18_cbam").pretrained_cfg["classifier"] == "fc"


def test_in_chans_and_ignored_img_size():
    model = zoo.create_model("resnet18", in_chans=1, img_size=64)
    assert model(torch.randn(2, 1, 40, 40)).shape == (2, 10)
    with pytest.raises(ValueError, match=r"\(B, 1, H, W\), got \(2, 3, 32, 32\)"):
        model(torch.randn(2, 3, 32, 32))


def test_resnet18_cbam_adds_one_cbam_per_block_and_loads_plain_weights():
    plain = zoo.create_model("resnet18")
    for m in plain.modules():  # timm zero-initialises each block's bn2 weight, which would hide CBAM
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
    model = zoo.create_model("resnet18_cbam")
    cbams = [m for m in model.modules() if isinstance(m, zoo.CBAM)]
    assert len(cbams) == 8
    result = model.load_state_dict(plain.state_dict(), strict=False)
    assert result.unexpected_keys == [] and result.missing_keys
    assert all(".cbam." in k for k in result.missing_keys)
    plain.eval(), model.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert not torch.allclose(model(x), plain(x), atol=1e-3)


@pytest.mark.parametrize("name", ["resnet18", "resnet18_cbam"])
def test_every_parameter_gets_a_gradient(name):
    model = zoo.create_model(name, num_classes=3, drop_path_rate=0.1)
    nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.tensor([0, 1, 2, 0])).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
