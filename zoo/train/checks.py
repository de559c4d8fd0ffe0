"""The checks of recipe values, one per kind of setting: each takes (dotted key, value) and returns the normalised
value or raises a one-line ValueError ``KEY must EXPECTED, got VALUE`` (``rule`` builds them; ``zoo.train.recipe``
attaches them to its fields); and the parsers of Lightning's ``DD:HH:MM:SS`` budgets and batch limits.

Every number has bounds that follow from where it goes: an integer fits torch's int64, a real number float32's
range (the optimizer and the schedule compute in it), a number of minutes Python's ``timedelta``, a path what the
file system takes."""

from __future__ import annotations

import copy
import math
import os
import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import reduce
from typing import Any

PRECISIONS = ("auto", "32", "bf16-mixed", "16-mixed")

Check = Callable[[str, Any], Any]   # (dotted key, value) -> normalised value, or ValueError


def rule(expected: str, ok: Callable[[Any], bool], normal: Callable[[Any], Any] = lambda value: value) -> Check:
    """A check passing ``value`` where ``ok(value)`` (as ``normal(value)``), else "KEY must EXPECTED, got VALUE"."""
    def check(key: str, value):
        if not ok(value):
            raise ValueError(f"{key} must {expected}, got {value!r}")
        return normal(value)
    return check


def chain(*checks: Check) -> Check:
    """The checks in turn, each given the value the previous one returned."""
    return lambda key, value: reduce(lambda passed, check: check(key, passed), checks, value)


def optional(check: Check) -> Check:
    """``check``, letting None (YAML null: unset) through."""
    return lambda key, value: None if value is None else check(key, value)


def choice(options: tuple) -> Check:
    return rule("be one of " + ", ".join(map(str, options)), lambda v: v in options and not isinstance(v, bool))


def flag(*words: str) -> Check:
    """true or false, or one of ``words``."""
    return rule("be " + ", ".join([*words, "true"]) + " or false", lambda v: isinstance(v, bool) or v in words)


INT64_MAX = 2**63 - 1             # torch's integers (seeds, counts, steps)
FLOAT32_MAX = 3.4028234663852886e38  # what the optimizer's and the schedule's float32 arithmetic holds
MAX_MINUTES = timedelta.max // timedelta(minutes=1)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float (10**400)
        return False


NATURAL = chain(rule("be a non-negative integer", lambda v: _integer(v) and v >= 0),
                rule(f"be at most 2**63 - 1 ({INT64_MAX:,})", lambda v: v <= INT64_MAX))
POSITIVE = chain(rule("be a positive integer", lambda v: _integer(v) and v >= 1), NATURAL)
NUMBER = chain(rule("be a non-negative number", lambda v: (_integer(v) or isinstance(v, float)) and not v < 0),
               rule("be a finite number", _finite, float),
               rule(f"be at most {FLOAT32_MAX:.4g} (float32's largest number)", lambda v: v <= FLOAT32_MAX))
SEED = chain(NATURAL, rule("be at most 2**32 - 1 (4294967295, the largest seed numpy and Lightning take)",
                          lambda v: v < 2**32))
MINUTES = chain(NUMBER, rule(f"be at most {MAX_MINUTES:,} minutes (Python's longest timedelta)",
                             lambda v: v <= MAX_MINUTES))
ABOVE_ZERO = chain(NUMBER, rule("be above zero", lambda v: v > 0))
UNIT_INTERVAL = chain(NUMBER, rule("lie in [0, 1)", lambda v: v < 1))
FRACTION = chain(NUMBER, rule("lie in (0, 1]", lambda v: 0 < v <= 1))
TEXT = rule("be a string", lambda v: v is not None and not isinstance(v, (bool, list, dict)), str)
NAME_MAX, PATH_MAX = 255, 4096  # bytes of a file name and of a path on Linux and macOS file systems (and NUL ends one)
PATH = chain(TEXT, lambda key, value: os.path.expanduser(value),  # ~/data in a config file as a shell reads it
             rule(f"be a path of file names up to {NAME_MAX} bytes each, {PATH_MAX} in all, without NUL",
                  lambda v: "\0" not in v and len(os.fsencode(v)) <= PATH_MAX
                  and all(len(os.fsencode(part)) <= NAME_MAX for part in v.split(os.sep))))
OPTIONAL_TEXT, OPTIONAL_PATH, COUNT, FLAG = optional(TEXT), optional(PATH), optional(POSITIVE), flag()
MAPPING = rule("be a mapping", lambda v: isinstance(v, Mapping), lambda v: copy.deepcopy(dict(v)))
PRECISION = rule("be one of " + ", ".join(PRECISIONS), lambda v: str(v) in PRECISIONS, str)  # YAML reads 32 as int
RANDAUGMENT = rule("be null, true, false or a mapping like {num_ops: 2, magnitude: 9}",
                   lambda v: isinstance(v, (bool, Mapping)), lambda v: v if isinstance(v, bool) else dict(v))
DEVICES = chain(  # a count written as text ("2", "-1") is the number
    lambda key, v: int(v) if isinstance(v, str) and re.fullmatch(r"\s*(-1|\d+)\s*", v) else v,
    rule("be auto, a number of devices (-1: all) or a device list like '0,1'",
         lambda v: v == "auto" or _integer(v) and (1 <= v <= INT64_MAX or v == -1)
         or isinstance(v, str) and bool(re.fullmatch(r"\d+(,\d+)*,?", v.replace(" ", "")))))


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
    if limit is not None and (isinstance(limit, bool) or limit < 0 or limit > 1 and limit % 1):  # 2.5: neither
        raise ValueError(f"{key} must be a batch limit: an integer (batches) or a fraction like 0.25, "
                         f"got {value!r}")
    return limit


def parse_max_time(value: str) -> float:
    """Lightning's ``DD:HH:MM:SS`` -> seconds."""
    match = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", str(value).strip())  # Lightning's Timer reads these
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
