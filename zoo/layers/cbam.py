"""CBAM, the Convolutional Block Attention Module (Woo et al., ECCV 2018, https://arxiv.org/abs/1807.06521):
a channel gate from average- and max-pooled descriptors through one shared MLP, then a spatial gate from
channel-wise mean and max maps through a k x k conv; both gates are sigmoids multiplied onto the features.

``add_cbam`` puts a CBAM into every residual block of a torchvision or timm ResNet, on the residual branch
after its last norm (``bn2`` in BasicBlock, ``bn3`` in Bottleneck) and before the addition: the last norm is
replaced by ``NormThenCBAM(norm, cbam)``, so ``bn2.weight`` becomes ``bn2.norm.weight`` and the CBAM's
parameters are ``bn2.cbam.*``. Being ordinary submodules on the forward path, they are seen by torch.fx
tracing (torchvision's feature extraction, timm's FX features), torch.export and torch.compile; a forward hook
(the first version) was invisible to FX, whose graphs lost CBAM. timm blocks have an ``se`` slot at that
place, but torchvision's do not, and one mechanism for both is simpler. Older names still load: a
load_state_dict pre-hook on each block renames an unmodified ResNet's ``bn2.*`` and the first version's
``cbam.*`` keys (``_legacy_cbam_keys``), so a plain ResNet's state_dict loads with ``strict=False`` (missing
only the CBAMs) and a checkpoint of the hook version loads strictly.

timm has a CBAM too (``timm.layers.CbamModule``), but its spatial gate adds a BatchNorm the formula here
does not have, it has no hook for recording gates, and timm marks it experimental; so the zoo has its own.
"""

from __future__ import annotations

import torch
from torch import nn

from .checks import tracing

__all__ = ["CBAM", "ChannelAttention", "NormThenCBAM", "SpatialAttention", "add_cbam", "current_cbam_keys"]


def _check_image(x, channels: int | None = None) -> None:
    if tracing():
        return
    expected = f"(B, {'C' if channels is None else channels}, H, W)"
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"CBAM expects a feature map of shape {expected}, got {got}")
    if channels is not None and x.shape[1] != channels:
        raise ValueError(f"CBAM expects a feature map of shape {expected} ({channels} channels), "
                         f"got {tuple(x.shape)} ({x.shape[1]} channels)")


def _stored_channels_last(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` (B, C, H, W) as its (B, H, W, C) view when it is stored channels-last, else None. Pooling that view
    gives gradients in ``x``'s own layout; the pools of the NCHW view return NCHW-ordered ones, which made each of
    autograd's sums with the gates' channels-last gradients a strided add (a tenth of an eager hybrid_tiny step on
    a CPU). None under torch.compile too: inductor picks its own layouts (and fails on this view's symbolic strides
    with dynamic shapes, torch 2.14)."""
    if tracing() or torch.compiler.is_compiling() or x.dim() != 4 or x.is_contiguous() \
            or not x.is_contiguous(memory_format=torch.channels_last):
        return None
    return x.permute(0, 2, 3, 1)


def _channel_pools(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, 2, H, W): the mean and the maximum over channels, the maximum through ``max``'s indices
    rather than ``amax``: their backward routes the gradient to the selected element instead of comparing the
    input with the maximum again. Under torch.compile with bf16 autocast that comparison can find no equal element
    (the input recomputed at another precision than the saved maximum) and divide by zero: NaN gradients (torch
    2.14, CPU inductor)."""
    last = _stored_channels_last(x)
    if last is not None:
        pools = [last.mean(dim=3, keepdim=True), last.max(dim=3, keepdim=True).values]
        return torch.cat(pools, dim=3).permute(0, 3, 1, 2)
    return torch.cat([x.mean(dim=1, keepdim=True), x.max(dim=1, keepdim=True).values], dim=1)


def _spatial_pools(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C, H, W) -> two (B, C, 1, 1): the mean and the maximum over positions, the maximum through ``max``'s
    indices as in ``_channel_pools`` (``amax`` over (H, W) gives NaN gradients the same way: whole-model
    torch.compile under bf16 autocast, CPU and CUDA)."""
    last = _stored_channels_last(x)
    if last is not None:
        positions = last.flatten(1, 2)  # (B, H * W, C)
        pools = positions.mean(dim=1), positions.max(dim=1).values
    else:
        positions = x.flatten(2)  # (B, C, H * W)
        pools = positions.mean(dim=2), positions.max(dim=2).values
    return pools[0][..., None, None], pools[1][..., None, None]


class ChannelAttention(nn.Module):
    """Channel gate: ``x * sigmoid(mlp(avgpool(x)) + mlp(maxpool(x)))`` with one shared MLP
    ``fc1`` (1x1 conv channels -> hidden), ReLU, ``fc2`` (hidden -> channels), no biases, and
    hidden = max(channels // reduction, 1). x: (B, channels, H, W) -> same shape."""

    def __init__(self, channels: int, reduction: int = 16):
        super().__init__()
        if channels < 1 or reduction < 1:
            raise ValueError(f"channels and reduction must be positive ints, got {channels} and {reduction}")
        hidden = max(channels // reduction, 1)
        self.channels = channels
        self.fc1 = nn.Conv2d(channels, hidden, 1, bias=False)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(hidden, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_image(x, self.channels)
        mean, peak = _spatial_pools(x)
        return x * torch.sigmoid(self.fc2(self.act(self.fc1(mean))) + self.fc2(self.act(self.fc1(peak))))


class SpatialAttention(nn.Module):
    """Spatial gate: ``x * sigmoid(conv([mean_c(x), max_c(x)]))`` with a k x k conv from 2 maps to 1
    (padding k // 2, no bias). x: (B, C, H, W) -> same shape.

    ``gate_hook``: None, or a callable that forward calls with the (B, 1, H, W) gate after the sigmoid
    (``zoo.record_attention`` sets it)."""

    def __init__(self, kernel_size: int = 7):
        super().__init__()
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int (a 'same' conv), got {kernel_size}")
        self.conv = nn.Conv2d(2, 1, kernel_size, padding=kernel_size // 2, bias=False)
        self.gate_hook = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_image(x)
        gate = torch.sigmoid(self.conv(_channel_pools(x)))  # (B, 1, H, W)
        if self.gate_hook is not None:
            self.gate_hook(gate)
        return x * gate


class CBAM(nn.Module):
    """Channel attention, then spatial attention. x: (B, channels, H, W) -> same shape."""

    def __init__(self, channels: int, reduction: int = 16, kernel_size: int = 7):
        super().__init__()
        self.channel = ChannelAttention(channels, reduction)
        self.spatial = SpatialAttention(kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spatial(self.channel(x))


class NormThenCBAM(nn.Module):
    """A residual block's last norm followed by a CBAM: ``cbam(norm(x))``, (B, C, H, W) -> same shape.
    ``add_cbam`` puts it in the norm's place."""

    def __init__(self, norm: nn.Module, cbam: CBAM):
        super().__init__()
        self.norm = norm
        self.cbam = cbam

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cbam(self.norm(x))


def _legacy_cbam_keys(block: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook of a block ``add_cbam`` changed: rename, in place, the keys of an unmodified
    block (``bn2.weight`` -> ``bn2.norm.weight``) and of the hook-based first version (``cbam.*`` ->
    ``bn2.cbam.*``) to today's names."""
    for name, child in block.named_children():
        if not isinstance(child, NormThenCBAM):
            continue
        norm_prefix, current = f"{prefix}{name}.", (f"{prefix}{name}.norm.", f"{prefix}{name}.cbam.")
        for key in [k for k in state_dict if k.startswith(norm_prefix) and not k.startswith(current)]:
            state_dict[current[0] + key.removeprefix(norm_prefix)] = state_dict.pop(key)
        for key in [k for k in state_dict if k.startswith(f"{prefix}cbam.")]:
            state_dict[current[1] + key.removeprefix(f"{prefix}cbam.")] = state_dict.pop(key)


def current_cbam_keys(model: nn.Module, state_dict: dict) -> dict:
    """A copy of ``state_dict`` with the keys ``model``'s CBAM blocks would rename on loading (plain and
    hook-version names, see ``_legacy_cbam_keys``) renamed: for code that matches keys by name before loading."""
    state_dict = dict(state_dict)
    for name, module in model.named_modules():
        if any(isinstance(child, NormThenCBAM) for child in module.children()):
            _legacy_cbam_keys(module, state_dict, f"{name}." if name else "")
    return state_dict


def _residual_blocks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(block, name of the last norm on its residual branch) for every torchvision / timm ResNet
    BasicBlock or Bottleneck (or subclass) in ``model``; ValueError if there is none."""
    from timm.models import resnet as timm_resnet
    from torchvision.models import resnet as tv_resnet

    last_norm = {tv_resnet.BasicBlock: "bn2", tv_resnet.Bottleneck: "bn3",
                 timm_resnet.BasicBlock: "bn2", timm_resnet.Bottleneck: "bn3"}
    blocks = []
    for module in model.modules():
        name = next((last_norm[cls] for cls in type(module).__mro__ if cls in last_norm), None)
        if name is not None:
            blocks.append((module, name))
    if not blocks:
        known = ", ".join(sorted({f"{c.__module__}.{c.__name__}" for c in last_norm}))
        raise ValueError(f"add_cbam expects a ResNet with residual blocks ({known}); "
                         f"{type(model).__name__} has none")
    return blocks


def add_cbam(model: nn.Module, reduction: int = 16, kernel_size: int = 7) -> nn.Module:
    """Insert a CBAM into every residual block (BasicBlock / Bottleneck) of a torchvision or timm ResNet, in
    place, after the block's last norm and before the residual addition; returns the model. The last norm
    ``bn`` becomes ``NormThenCBAM(bn, CBAM(bn.num_features, ...))`` (expansion x planes channels in a
    Bottleneck): parameters ``bn2.norm.*`` and ``bn2.cbam.*`` (``bn3`` in a Bottleneck). The unmodified
    model's state_dict still loads (``strict=False``, missing only ``*.cbam.*``), as does one saved by the
    hook-based first version (keys ``bn2.*`` and ``cbam.*``). A model without such blocks, or whose blocks
    already have a CBAM -> ValueError."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"add_cbam: model must be a torchvision or timm ResNet (an nn.Module), got {model!r}")
    blocks = _residual_blocks(model)
    if any(isinstance(getattr(block, norm_name), NormThenCBAM) for block, norm_name in blocks):
        raise ValueError("add_cbam: this model's residual blocks already have a CBAM")
    for block, norm_name in blocks:
        norm = getattr(block, norm_name)
        like = next(block.parameters())
        cbam = CBAM(norm.num_features, reduction, kernel_size).to(like.device, like.dtype)
        setattr(block, norm_name, NormThenCBAM(norm, cbam))
        block.register_load_state_dict_pre_hook(_legacy_cbam_keys)
    return model
