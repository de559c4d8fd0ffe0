"""Argument checks shared by the layers' constructors and forwards. A wrong argument becomes a ``ValueError``
that names the argument, what was expected and what was given, before it can fail obscurely inside torch
(``TypeError: cannot unpack``, a float size passed to ``torch.zeros``, a dropout rate torch does accept).

Checks of forward inputs step aside while ``torch.fx`` traces symbolically (``tracing()``): the input is then a
Proxy whose shape is not known, so the check cannot run, and an input check is not part of the computation
anyway. ``torch.compile`` and ``torch.export`` run the checks on real or fake tensors as eager mode does."""

from __future__ import annotations

import numbers

import torch

try:
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing
except ImportError:  # torch < 2.5: the flag is only set by symbolic tracing there
    from torch.fx._symbolic_trace import is_fx_tracing as is_fx_symbolic_tracing


def tracing() -> bool:
    """True while ``torch.fx`` traces symbolically (``symbolic_trace``, torchvision's ``create_feature_extractor``,
    timm's FX features); forward-input checks return early then."""
    return is_fx_symbolic_tracing()


def check_int(name: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int >= ``minimum`` (and <= ``maximum`` where given); bools and floats (even 2.0) are
    refused."""
    wrong = isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum
    if wrong or maximum is not None and value > maximum:
        expected = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum:,}]"
        raise ValueError(f"{name} must be an int {expected}, got {value!r}")
    return int(value)


def check_rate(name: str, value) -> float:
    """``value`` as a dropout probability in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}")
    return float(value)


def check_grid(name: str, value) -> tuple[int, int]:
    """``value`` as a (gh, gw) pair of positive ints."""
    pair = isinstance(value, (tuple, list)) and len(value) == 2
    if not pair or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1 for v in value):
        raise ValueError(f"{name} must be two positive ints (gh, gw), got {value!r}")
    return int(value[0]), int(value[1])


def check_dtype(name: str, x: torch.Tensor, expected: torch.dtype) -> None:
    """``x`` must have the dtype of the weights it meets (``expected``), unless autocast casts it on the way."""
    if x.dtype != expected and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(f"{name} has dtype {x.dtype}, the module's weights {expected}: cast one to the other "
                         f"(x.to({expected}) or module.to({x.dtype})), or run it under torch.autocast")


def check_flag(name: str, value) -> bool:
    """``value`` must be a bool (not a truthy string or tensor)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value
