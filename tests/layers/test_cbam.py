"""CBAM against the paper's formulas written out by hand (matmuls and shifted slices, no conv), and
add_cbam on torchvision and timm ResNets against a hand-written residual block."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
from timm.models import resnet as timm_resnet
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.models import resnet as tv_resnet

import zoo

BLOCK_TYPES = (tv_resnet.BasicBlock, tv_resnet.Bottleneck, timm_resnet.BasicBlock, timm_resnet.Bottleneck)


def channel_gate_reference(x, w1, w2):
    """sigmoid(W1 relu(W0 avg) + W1 relu(W0 max)) as (B, C, 1, 1); w1: (hidden, C), w2: (C, hidden)."""
    mlp = lambda v: torch.relu(v @ w1.T) @ w2.T
    gate = torch.sigmoid(mlp(x.mean(dim=(2, 3))) + mlp(x.amax(dim=(2, 3))))
    return gate[:, :, None, None]


def spatial_gate_reference(x, weight):
    """sigmoid(sum over maps and kernel offsets of w * shifted map) as (B, 1, H, W); weight: (1, 2, k, k)."""
    k = weight.shape[-1]
    maps = torch.stack([x.mean(dim=1), x.amax(dim=1)], dim=1)  # (B, 2, H, W)
    padded = F.pad(maps, (k // 2,) * 4)
    h, w = x.shape[-2:]
    out = torch.zeros(x.shape[0], h, w, dtype=x.dtype)
    for c in range(2):
        for u in range(k):
            for v in range(k):
                out += weight[0, c, u, v] * padded[:, c, u:u + h, v:v + w]
    return torch.sigmoid(out)[:, None]


def test_channel_attention_matches_formula():
    module = zoo.ChannelAttention(32, reduction=8)
    x = torch.randn(3, 32, 5, 7)
    w1, w2 = module.fc1.weight[:, :, 0, 0], module.fc2.weight[:, :, 0, 0]
    assert w1.shape == (4, 32) and w2.shape == (32, 4)
    torch.testing.assert_close(module(x), x * channel_gate_reference(x, w1, w2))


def test_channel_attention_hidden_width_is_at_least_one():
    assert zoo.ChannelAttention(8, reduction=16).fc1.out_channels == 1


def test_spatial_attention_matches_formula_and_reports_gate():
    module = zoo.SpatialAttention(kernel_size=7)
    seen = []
    module.gate_hook = seen.append
    x = torch.randn(2, 6, 9, 10)
    gate = spatial_gate_reference(x, module.conv.weight.detach())
    torch.testing.assert_close(module(x), x * gate)
    assert len(seen) == 1 and seen[0].shape == (2, 1, 9, 10)
    torch.testing.assert_close(seen[0], gate)
    assert 0 <= seen[0].min() and seen[0].max() <= 1


def test_cbam_is_channel_then_spatial():
    module = zoo.CBAM(16, reduction=4, kernel_size=3)
    x = torch.randn(2, 16, 6, 6)
    after_channel = x * channel_gate_reference(x, module.channel.fc1.weight[:, :, 0, 0],
                                               module.channel.fc2.weight[:, :, 0, 0])
    expected = after_channel * spatial_gate_reference(after_channel, module.spatial.conv.weight.detach())
    torch.testing.assert_close(module(x), expected)


@pytest.mark.parametrize("module, x", [
    (zoo.CBAM(16), torch.randn(2, 16, 4)),  # wrong rank
    (zoo.CBAM(16), torch.randn(2, 8, 4, 4)),  # wrong channel count
    (zoo.ChannelAttention(16), torch.randn(16, 4, 4)),
    (zoo.SpatialAttention(), torch.randn(2, 16)),
])
def test_bad_inputs_raise(module, x):
    with pytest.raises(ValueError, match=r"\(B, "):
        module(x)


def test_even_spatial_kernel_raises():
    with pytest.raises(ValueError, match="odd"):
        zoo.SpatialAttention(kernel_size=4)


def reference_block(block: nn.Module, cbam: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A torchvision / timm BasicBlock or Bottleneck written out, with ``cbam`` after the last norm."""
    out = F.relu(block.bn1(block.conv1(x)))
    out = block.bn2(block.conv2(out))
    if hasattr(block, "conv3"):
        out = block.bn3(block.conv3(F.relu(out)))
    shortcut = x if block.downsample is None else block.downsample(x)
    return F.relu(cbam(out) + shortcut)


def _randomise_norms(model: nn.Module) -> nn.Module:
    """timm zero-initialises the last norm of each block; random affine BN weights and statistics make the
    residual branch (and so CBAM's effect) visible."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.normal_(m.bias, std=0.1)
            m.running_mean.normal_(std=0.1)
            m.running_var.uniform_(0.5, 1.5)
    return model


RESNETS = {
    "torchvision_resnet18": lambda: torchvision.models.resnet18(weights=None),
    "torchvision_resnet50": lambda: torchvision.models.resnet50(weights=None),
    "timm_resnet18": lambda: timm.create_model("resnet18", pretrained=False),
    "timm_resnet50": lambda: timm.create_model("resnet50", pretrained=False),
}


@pytest.mark.parametrize("name", list(RESNETS))
def test_add_cbam_loads_the_plain_state_dict_and_places_cbam_before_the_addition(name):
    plain = _randomise_norms(RESNETS[name]()).eval()
    blocks = {n: m for n, m in plain.named_modules() if isinstance(m, BLOCK_TYPES)}
    model = RESNETS[name]()
    assert zoo.add_cbam(model) is model
    result = model.load_state_dict(plain.state_dict(), strict=False)
    assert result.unexpected_keys == []
    bottleneck = "50" in name
    norm_name = "bn3" if bottleneck else "bn2"
    cbam_keys = {"channel.fc1.weight", "channel.fc2.weight", "spatial.conv.weight"}
    assert set(result.missing_keys) == {f"{n}.{norm_name}.cbam.{k}" for n in blocks for k in cbam_keys}
    model.eval()

    for n, block in blocks.items():
        added = model.get_submodule(f"{n}.{norm_name}.cbam")
        assert model.get_submodule(f"{n}.{norm_name}.norm") is not getattr(block, norm_name)
        torch.testing.assert_close(model.get_submodule(f"{n}.{norm_name}.norm").running_var,
                                   getattr(block, norm_name).running_var)
        last_norm = block.bn3 if bottleneck else block.bn2
        assert added.channel.fc2.out_channels == last_norm.num_features
        if bottleneck:  # expansion x planes
            assert last_norm.num_features == 4 * block.conv1.out_channels

    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        logits = model(x)
        assert logits.shape == (2, 1000)
        assert not torch.allclose(logits, plain(x), atol=1e-3)  # CBAM changes the output
        first_name, first = next(iter(blocks.items()))
        stem_out = x
        for child in ("conv1", "bn1", "act1" if hasattr(plain, "act1") else "relu", "maxpool"):
            stem_out = getattr(plain, child)(stem_out)
        cbam = model.get_submodule(f"{first_name}.{norm_name}.cbam")
        torch.testing.assert_close(model.get_submodule(first_name)(stem_out),
                                   reference_block(first, cbam, stem_out))


def test_add_cbam_gradients_reach_cbam_and_deepcopy_uses_its_own_cbam():
    model = zoo.add_cbam(torchvision.models.resnet18(weights=None, num_classes=4))
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    for name, p in model.named_parameters():
        if ".cbam." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.eval()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x))
        twin.layer1[0].bn2.cbam.spatial.conv.weight.add_(1.0)
        assert not torch.allclose(twin(x), model(x))


def test_add_cbam_loads_the_state_dict_of_the_hook_based_version_strictly():
    """The first add_cbam kept ``bn2.*`` and added ``cbam.*`` beside it (a forward hook ran one after the
    other); such a state_dict loads strictly and gives the same function."""
    model = zoo.add_cbam(_randomise_norms(torchvision.models.resnet18(weights=None, num_classes=4))).eval()
    old_names = {k.replace(".bn2.norm.", ".bn2.").replace(".bn2.cbam.", ".cbam."): v
                 for k, v in model.state_dict().items()}
    assert "layer1.0.bn2.weight" in old_names and "layer1.0.cbam.spatial.conv.weight" in old_names
    fresh = zoo.add_cbam(torchvision.models.resnet18(weights=None, num_classes=4)).eval()
    fresh.load_state_dict(old_names, strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_add_cbam_is_visible_to_fx_and_export():
    """CBAM is an ordinary submodule on the forward path: an FX graph keeps its parameters and its effect."""
    model = zoo.add_cbam(_randomise_norms(torchvision.models.resnet18(weights=None, num_classes=4))).eval()
    traced = torch.fx.symbolic_trace(model)
    assert sum(p.numel() for p in traced.parameters()) == sum(p.numel() for p in model.parameters())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(traced(x), model(x))


@pytest.mark.parametrize("model", [nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()), nn.Linear(3, 3)])
def test_add_cbam_without_residual_blocks_raises(model):
    with pytest.raises(ValueError, match="residual blocks"):
        zoo.add_cbam(model)


def test_add_cbam_twice_raises():
    model = zoo.add_cbam(torchvision.models.resnet18(weights=None))
    with pytest.raises(ValueError, match="already"):
        zoo.add_cbam(model)


class _GradientSums(TorchDispatchMode):
    """For every 4-D ``add`` autograd makes: whether its two operands are laid out alike (the same strides)."""

    def __init__(self):
        super().__init__()
        self.alike = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in ("aten::add", "aten::add_") and all(
                isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[2] * a.shape[3] > 1 for a in args[:2]):
            self.alike.append(args[0].stride() == args[1].stride())
        return func(*args, **(kwargs or {}))


def test_a_channels_last_input_gets_its_gradient_in_one_layout_from_every_branch():
    """The CBAM input's gradient is summed over its branches (the product with the gates, their means and maxima):
    each branch's part in the input's channels-last layout, so no sum is a strided add of two layouts; the values
    equal those of the same input stored NCHW."""
    torch.manual_seed(0)
    cbam = zoo.CBAM(32, reduction=4)
    x = torch.randn(4, 32, 8, 8)
    grads, outputs = [], []
    for layout in (torch.contiguous_format, torch.channels_last):
        leaf = x.clone().contiguous(memory_format=layout).requires_grad_()
        cbam.to(memory_format=layout)  # as a channels-last model converts its convs
        y = cbam(leaf * 1.0)  # a non-leaf input, whose branches' gradients autograd adds up
        with _GradientSums() as sums:
            y.backward(torch.ones_like(y))
        outputs.append(y.detach())
        grads.append(leaf.grad)
    assert sums.alike and all(sums.alike), sums.alike
    torch.testing.assert_close(outputs[1], outputs[0])
    torch.testing.assert_close(grads[1], grads[0])
