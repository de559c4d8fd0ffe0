"""Argument checks shared by the layers' constructors and forwards. A wrong argument becomes a ``ValueError``
that names the argument, what was expected and what was given, before it can fail obscurely inside torch
(``TypeError: cannot unpack``, a float size passed to ``torch.zeros``, a dropout rate torch does accept)."""

from __future__ import annotations

import numbers


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``; bools and floats (even 2.0) are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
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


def check_flag(name: str, value) -> bool:
    """``value`` must be a bool (not a truthy string or tensor)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value
