"""The zoo's model registry: ``register_model`` decorates an entry point (its function name is the model
name), ``create_model`` / ``list_models`` look them up, ``model_info`` counts parameters and FLOPs,
``check_model_fits`` builds a model on the meta device to refuse what could not be built here before anything is
allocated.
Every entry point is mirrored into timm's registry as ``zoo_<name>``, so ``timm.create_model`` finds it."""

from __future__ import annotations

import copy
import difflib
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from timm.layers import to_2tuple
from timm.models import build_model_with_cfg
from timm.models import register_model as timm_register_model
from torch import nn
from torch.overrides import TorchFunctionMode

from .arguments import check_arguments

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"  # shipped weights: <name>/ in the Hub layout
HUB_CONFIG, HUB_WEIGHTS = "config.json", "model.safetensors"  # a Hub folder's files timm reads (zoo.models.hub)

_entrypoints: dict[str, Callable[..., nn.Module]] = {}  # zoo name -> the timm entry point (build_model_with_cfg)
_builders: dict[str, Callable[..., nn.Module]] = {}  # zoo name -> the decorated function (its signature, return)
default_cfgs: dict[str, dict] = {}  # read by timm's register_model for the zoo_<name> pretrained cfgs


def shipped_config(name: str) -> dict | None:
    """config.json of ``name``'s shipped weights (``zoo/weights/<name>/``, the Hub layout of ``zoo.models.hub``),
    or None when the zoo ships no weights for it."""
    path = WEIGHTS_DIR / name.removeprefix("zoo_") / HUB_CONFIG
    return json.loads(path.read_text()) if path.is_file() else None


def model_card(name: str) -> dict | None:
    """The model card of ``name``'s shipped weights (recipe, command, machine, accuracy, mean / std of the
    training data, ...: config.json's ``model_card``), or None when the zoo ships no weights for it."""
    config = shipped_config(name)
    return config["model_card"] if config else None


def _pretrained_cfg(name: str, first_conv: str, classifier: str, fixed_input_size: bool,
                    pool_size: tuple[int, int] | None) -> dict:
    """timm's pretrained cfg of ``zoo_<name>``: the shipped weights' file and the pretrained cfg of their
    config.json (the mean / std their training data was normalised with, label names, ...), or (no weights) the
    usual CIFAR-10 statistics."""
    cfg = dict(
        url="", num_classes=10, input_size=(3, 32, 32), pool_size=pool_size, crop_pct=1.0, crop_mode="center",
        interpolation="bicubic", fixed_input_size=fixed_input_size, mean=CIFAR10_MEAN, std=CIFAR10_STD,
        first_conv=first_conv, classifier=classifier, license="apache-2.0",
    )
    shipped = shipped_config(name)
    if shipped is not None:  # the pretrained cfg timm's local-dir: reads from the same folder
        cfg.update({key: tuple(value) if isinstance(value, list) else value
                    for key, value in shipped["pretrained_cfg"].items()})
        cfg["file"] = str(WEIGHTS_DIR / name / HUB_WEIGHTS)
    return cfg


def _timm_entrypoint(name: str, fn: Callable[..., nn.Module], feature_cfg: dict | None) -> Callable[..., nn.Module]:
    timm_name = f"zoo_{name}"

    def entrypoint(pretrained: bool = False, **kwargs) -> nn.Module:
        try:
            return build_model_with_cfg(fn, timm_name, pretrained, feature_cfg=dict(feature_cfg or {}), **kwargs)
        except RuntimeError as err:  # timm's "No pretrained weights exist for ..." when the cfg has no source
            if not str(err).startswith("No pretrained weights exist"):
                raise
            raise ValueError(f"{timm_name} has no pretrained weights (the zoo ships weights for: "
                             f"{', '.join(shipped_models()) or 'no model'}); create it with pretrained=False "
                             "and load a trained run with zoo.load_run(...)") from None

    entrypoint.__name__ = entrypoint.__qualname__ = timm_name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = fn.__doc__
    return entrypoint


def shipped_models() -> list[str]:
    """Names of the zoo models whose trained weights ship in the package, sorted."""
    return sorted(p.parent.name for p in WEIGHTS_DIR.glob(f"*/{HUB_CONFIG}") if (p.parent / HUB_WEIGHTS).is_file())


def register_model(first_conv: str, classifier: str = "head", *, fixed_input_size: bool = False,
                   pool_size: tuple[int, int] | None = None, feature_cfg: dict | None = None):
    """Decorator for a zoo entry point (its function name is the model name). It is registered in timm as
    ``zoo_<name>``, built through timm's ``build_model_with_cfg`` (``pretrained``, ``features_only``,
    ``in_chans`` / ``num_classes`` adaptation of pretrained weights work as for timm's models). ``first_conv``
    / ``classifier`` are the module names of the pretrained cfg, ``fixed_input_size`` whether the model
    accepts only its ``img_size``, ``pool_size`` the (h, w) of the final feature map at 32x32 (None for
    token models), ``feature_cfg`` the features_only defaults."""

    def decorator(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        name = fn.__name__
        default_cfgs[f"zoo_{name}"] = _pretrained_cfg(name, first_conv, classifier, fixed_input_size, pool_size)
        entrypoint = _timm_entrypoint(name, fn, feature_cfg)
        timm_register_model(entrypoint)
        _entrypoints[name] = entrypoint
        _builders[name] = fn
        return fn

    return decorator


def list_models() -> list[str]:
    """Names of every registered zoo model, sorted."""
    return sorted(_entrypoints)


def create_model(name: str, pretrained: bool = False, **kwargs) -> nn.Module:
    """Build a registered model, e.g. ``create_model("vit_tiny", num_classes=10, img_size=32)``: the same
    model ``timm.create_model("zoo_" + name, ...)`` builds. ``pretrained=True`` loads the weights the zoo
    ships (``shipped_models()``; a head of another ``num_classes`` is re-initialised, other ``in_chans``
    adapted, as timm does). The ``zoo_`` prefix is accepted too. Unknown name -> ValueError with close
    matches; an argument of the wrong type (``img_size="32"``, ``depth=2.5``) -> ValueError naming it, before
    anything is built."""
    key = name.removeprefix("zoo_") if isinstance(name, str) else name
    if key not in _entrypoints:
        close = difflib.get_close_matches(str(key), list_models(), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown model {name!r}{hint} Available: {', '.join(list_models())}")
    num_classes = kwargs.get("num_classes", 0)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
        raise ValueError(f"num_classes must be an int >= 0 (0: pooled features, no head), got {num_classes!r}")
    check_arguments(key, _builders[key], kwargs, unknown_ok=True)  # timm's builder takes more (features_only)
    model = _entrypoints[key](pretrained=pretrained, **kwargs)
    if not kwargs.get("features_only"):
        model.zoo_name = key
        model.zoo_kwargs = dict(kwargs)
    return model


_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint, torch.arange,
              torch.linspace, torch.tensor, torch.eye, torch.empty_strided}


class _TooLarge(Exception):
    pass


class _CountElements(TorchFunctionMode):
    """Counts the elements of the tensors a constructor makes and stops it once they pass ``limit``, so an
    oversized model is refused after its first large tensor rather than after building all of it."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.count = limit, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _FACTORIES and isinstance(out, torch.Tensor):
            self.count += out.numel()
            if self.count > self.limit:
                raise _TooLarge
        return out


def host_memory_bytes() -> int:
    """This machine's physical memory (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_model_fits(name: str, memory_bytes: int | None = None, **kwargs) -> int:
    """The parameter and buffer elements of ``create_model(name, **kwargs)``, found by building it on the meta
    device (nothing is allocated), so the constructor's own checks run too (``drop_path_rate=2.0``). ValueError
    in one line where an argument is wrong or the model in float32 would not fit ``memory_bytes`` (default: this
    machine's memory): ``num_classes=10**12`` is refused in a fraction of a second, not by the out-of-memory
    killer."""
    memory = host_memory_bytes() if memory_bytes is None else memory_bytes
    limit = memory // 4 if memory else 2**62
    counter = _CountElements(limit)
    try:
        with torch.device("meta"), counter:
            model = create_model(name, **kwargs)
        count = sum(t.numel() for t in itertools.chain(model.parameters(), model.buffers()))
    except _TooLarge:
        count = counter.count
    except (RuntimeError, ArithmeticError, TypeError) as err:  # a size torch cannot represent (embed_dim=10**30)
        raise ValueError(f"{name} cannot be built with {kwargs}: {str(err).splitlines()[0]}") from None
    if count > limit:
        raise ValueError(f"{name} with {kwargs} would hold over {count:,} parameter elements ({count * 4 / 2**30:,.0f}"
                         f" GiB in float32), more than this machine's {memory / 2**30:,.0f} GiB of memory")
    return count


def check_model_args(name: str, arguments: dict, prefix: str = "") -> None:
    """ValueError unless registered model ``name``'s constructor takes each of ``arguments`` with a value of its
    annotated type (``zoo.models.arguments``); the message names the valid arguments and the closest one."""
    check_arguments(name, _builders[name.removeprefix("zoo_")], arguments, prefix=prefix)


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


def models_table() -> str:
    """One line per registered model: name, parameters, forward FLOPs per 32x32 image, shipped weights or not."""
    lines = [f"{'model':16} {'params':>12} {'FLOPs/image':>14}  weights"]
    for name in list_models():
        info = model_info(create_model(name))
        lines.append(f"{name:16} {info['params']:>12,} {info['flops']:>14,}  "
                     f"{'shipped' if name in shipped_models() else '-'}")
    return "\n".join(lines)
