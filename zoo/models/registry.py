"""The zoo's model registry: ``register_model`` decorates an entry point (its function name is the model
name), ``create_model`` / ``list_models`` look them up, ``model_info`` counts parameters and FLOPs.
Every entry point is mirrored into timm's registry as ``zoo_<name>``, so ``timm.create_model`` finds it."""

from __future__ import annotations

import copy
import difflib
import itertools
from collections.abc import Callable

import torch
from timm.layers import to_2tuple
from timm.models import register_model as timm_register_model
from torch import nn

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

_entrypoints: dict[str, Callable[..., nn.Module]] = {}
default_cfgs: dict[str, dict] = {}  # read by timm's register_model for the zoo_<name> pretrained cfgs


def _timm_entrypoint(name: str, fn: Callable[..., nn.Module], first_conv: str, classifier: str):
    timm_name = f"zoo_{name}"

    def entrypoint(pretrained: bool = False, pretrained_cfg=None, pretrained_cfg_overlay=None, cache_dir=None,
                   **kwargs):
        if pretrained:
            raise ValueError(f"{timm_name} has no pretrained weights on any hub; create it with "
                             "pretrained=False and load a trained run with zoo.load_run(...)")
        model = fn(**kwargs)
        model.pretrained_cfg = model.default_cfg = dict(default_cfgs[timm_name])  # read by timm.data
        return model

    entrypoint.__name__ = entrypoint.__qualname__ = timm_name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = fn.__doc__
    default_cfgs[timm_name] = dict(
        url="", num_classes=10, input_size=(3, 32, 32), pool_size=None, crop_pct=1.0, interpolation="bicubic",
        mean=CIFAR10_MEAN, std=CIFAR10_STD, first_conv=first_conv, classifier=classifier,
    )
    timm_register_model(entrypoint)


def register_model(first_conv: str, classifier: str = "head"):
    """Decorator for a zoo entry point; ``first_conv`` / ``classifier`` are the module names timm's
    pretrained cfg records (for adapting input channels and heads)."""

    def decorator(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        _entrypoints[fn.__name__] = fn
        _timm_entrypoint(fn.__name__, fn, first_conv, classifier)
        return fn

    return decorator


def list_models() -> list[str]:
    """Names of every registered zoo model, sorted."""
    return sorted(_entrypoints)


def create_model(name: str, **kwargs) -> nn.Module:
    """Build a registered model, e.g. ``create_model("vit_tiny", num_classes=10, img_size=32)``.
    The ``zoo_`` prefix timm uses is accepted too. Unknown name -> ValueError with close matches."""
    key = name.removeprefix("zoo_") if isinstance(name, str) else name
    if key not in _entrypoints:
        close = difflib.get_close_matches(str(key), list_models(), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown model {name!r}{hint} Available: {', '.join(list_models())}")
    model = _entrypoints[key](**kwargs)
    model.zoo_name = key
    model.zoo_kwargs = dict(kwargs)
    return model


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """q k^T and weights v of one fused SDPA call: 2 * B * H * N * M * (D + Dv), the formula
    torch.utils.flop_counter applies to its CUDA SDPA kernels."""
    b, h, n, d = query_shape
    m, dv = key_shape[-2], value_shape[-1]
    return 2 * b * h * n * m * (d + dv)


# the fused SDPA forward kernels torch's FLOP counter has no formula for (torch 2.14): CPU (the one
# F.scaled_dot_product_attention runs on CPU, without dropout), XPU / PrivateUse1 devices, MPS
_SDPA_FLOPS = {op: _sdpa_flops for op in (
    getattr(torch.ops.aten, name, None) for name in ("_scaled_dot_product_flash_attention_for_cpu",
                                                     "_scaled_dot_product_fused_attention_overrideable",
                                                     "_scaled_dot_product_attention_math_for_mps"))
    if op is not None}


def _counting_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules in eval mode that shares (does not copy) every parameter and buffer: a
    forward through it reads the model's weights but cannot change the model. Hooks come along (torch drops
    the compiled code of ``module.compile()``, so the copy runs eagerly)."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo=shared).eval()


def model_info(model: nn.Module, input_size: tuple[int, int, int] | None = None) -> dict:
    """{'params', 'trainable_params', 'flops', 'input_size'}: flops are forward FLOPs per image (a multiply-add
    counts 2) in eval mode, counted by torch.utils.flop_counter on one zero image.

    The model is left as it is, also during the count: the forward runs on ``_counting_copy(model)``, so no
    module's training flag or backend is touched, no BatchNorm statistic updated, no random number drawn.
    Attention counts as each module runs it in the current ``zoo.attention_backend`` setting: sdpa (through
    ``_SDPA_FLOPS`` for the CPU kernel), math and chunked all count q k^T and weights v, 2 * N * M * dim each
    per image; the linear backend counts its own (fewer, for long sequences) products."""
    from torch.utils.flop_counter import FlopCounterMode

    if input_size is None:
        input_size = (getattr(model, "in_chans", 3), *to_2tuple(getattr(model, "img_size", 32)))
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    p = next(model.parameters())
    x = torch.zeros(1, *input_size, device=p.device, dtype=p.dtype)
    counted = _counting_copy(model)
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_SDPA_FLOPS) as counter:
        counted(x)
    return {"params": params, "trainable_params": trainable, "flops": int(counter.get_total_flops()),
            "input_size": tuple(input_size)}
