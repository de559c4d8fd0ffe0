"""The checks of recipe values, one per kind of setting: each takes (dotted key, value) and returns the normalised
value or raises a ValueError naming the key, what was expected and what was given (``zoo.train.recipe`` attaches
them to its fields); and the parsers of Lightning's ``DD:HH:MM:SS`` budgets and batch limits."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

PRECISIONS = ("auto", "32", "bf16-mixed", "16-mixed")

Check = Callable[[str, Any], Any]   # (dotted key, value) -> normalised value, or ValueError
After = Callable[[str, Any, Any], None]  # (dotted key, checked value, the whole config) -> None, or ValueError


def integer_check(low: int) -> Check:
    expected = {0: "a non-negative integer", 1: "a positive integer"}[low]

    def check(key: str, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{key} must be {expected}, got {value!r}")
        return value
    return check


def number_check(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{key} must be a non-negative number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def positive_check(key: str, value) -> float:
    value = number_check(key, value)
    if value == 0:
        raise ValueError(f"{key} must be above zero, got {value!r}")
    return value


def text_check(key: str, value) -> str:
    if isinstance(value, (bool, list, dict)) or value is None:
        raise ValueError(f"{key} must be a string, got {value!r}")
    return str(value)


def mapping_check(key: str, value) -> dict:
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a mapping, got {value!r}")
    return copy.deepcopy(dict(value))


def optional_check(check: Check) -> Check:
    return lambda key, value: None if value is None else check(key, value)


def choice_check(options: tuple) -> Check:
    def check(key: str, value):
        if value not in options or isinstance(value, bool):
            raise ValueError(f"{key} must be one of {', '.join(map(str, options))}, got {value!r}")
        return value
    return check


def unit_interval_check(key: str, value) -> float:
    value = number_check(key, value)
    if value >= 1:
        raise ValueError(f"{key} must lie in [0, 1), got {value!r}")
    return value


def fraction_check(key: str, value) -> float:
    value = number_check(key, value)
    if not 0 < value <= 1:
        raise ValueError(f"{key} must lie in (0, 1], got {value!r}")
    return value


def precision_check(key: str, value) -> str:
    if str(value) not in PRECISIONS:
        raise ValueError(f"{key} must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return str(value)


def devices_check(key: str, value) -> int | str:
    if isinstance(value, str) and re.fullmatch(r"\s*(-1|\d+)\s*", value):
        value = int(value)
    valid = value == "auto" or isinstance(value, str) and re.fullmatch(r"\d+(,\d+)*,?", value.replace(" ", ""))
    if isinstance(value, bool) or not (valid or isinstance(value, int) and (value >= 1 or value == -1)):
        raise ValueError(f"{key} must be auto, a number of devices (-1: all) or a device list like '0,1', "
                         f"got {value!r}")
    return value


def flag_check(*words: str) -> Check:
    """true or false, or one of ``words``."""
    expected = ", ".join([*words, "true"]) + " or false"

    def check(key: str, value) -> bool | str:
        if value not in words and not isinstance(value, bool):
            raise ValueError(f"{key} must be {expected}, got {value!r}")
        return value
    return check


def max_time_check(key: str, value) -> str:
    if parse_max_time(value) <= 0:
        raise ValueError(f"{key} {value!r} leaves no time for one training step: give a budget above zero, "
                         "e.g. 00:00:10:00")
    return str(value)


def limit_check(key: str, value) -> int | float | None:
    try:
        limit = parse_limit(value)
    except ValueError:
        limit = -1
    if limit is not None and (isinstance(limit, bool) or limit < 0):
        raise ValueError(f"{key} must be a batch limit: an integer (batches) or a fraction like 0.25, "
                         f"got {value!r}")
    return limit


def randaugment_check(key: str, value) -> dict | bool:
    if not isinstance(value, (bool, Mapping)):
        raise ValueError(f"{key} must be null, true, false or a mapping like {{num_ops: 2, magnitude: 9}}, "
                         f"got {value!r}")
    return value if isinstance(value, bool) else dict(value)


def parse_max_time(value: str) -> float:
    """Lightning's ``DD:HH:MM:SS`` -> seconds."""
    match = re.fullmatch(r"(\d+):(\d+):(\d+):(\d+)", str(value).strip())
    if not match:
        raise ValueError(f"--max-time expects DD:HH:MM:SS (e.g. 00:00:10:00), got {value!r}")
    days, hours, minutes, seconds = map(int, match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def parse_limit(value) -> int | float | None:
    """Lightning's limit_*_batches: an integer is a number of batches, a number with a point a fraction."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    try:
        return float(text) if "." in text or "e" in text.lower() else int(text)
    except ValueError:
        raise ValueError(f"a batch limit must be an integer (batches) or a fraction like 0.25, "
                         f"got {value!r}") from None
