"""Reading a run directory's summary.json, metrics.csv and config.yaml back, checked: a file that is truncated, not the
expected shape, or holds a value of the wrong type -> ValueError in one line naming the file and what is wrong
(never a TypeError or a bare JSON / float message from deep inside). ``--resume``, ``load_run`` and eval.py read
them through here."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

# summary.json keys other code reads, with the types they must have (None allowed for the optional scores)
_NUMBER = (int, float)
SUMMARY_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "num_classes": (int,), "img_size": (int,), "global_step": (int,), "epochs": (int,),
    "class_names": (list,), "mean": (list,), "std": (list,), "test_top1": _NUMBER, "test_top5": _NUMBER,
    "best_val_top1": _NUMBER + (type(None),), "label_smoothing": _NUMBER, "params": (int,), "flops": (int,),
}


def _bad(path: Path, what: str) -> ValueError:
    return ValueError(f"{path} is damaged ({what}); restore it, or delete it (a run without it is resumed and "
                      "evaluated from its checkpoint)")


def read_summary(path: str | Path) -> dict:
    """The JSON object in ``path`` (a run's summary.json), its known keys type-checked: ``class_names`` a list of
    strings (as many as ``num_classes`` where both are there), ``mean`` / ``std`` 3 finite numbers each."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise _bad(path, "not text") from None
    except json.JSONDecodeError as err:
        raise _bad(path, f"not JSON: {err.msg} at line {err.lineno}") from None
    if not isinstance(data, dict):
        raise _bad(path, f"a JSON {type(data).__name__}, not an object")
    for key, types in SUMMARY_TYPES.items():
        value = data.get(key)
        if key in data and (not isinstance(value, types) or isinstance(value, bool)):
            raise _bad(path, f"{key} is {value!r}, expected {' or '.join(t.__name__ for t in types)}")
    names = data.get("class_names")
    if names is not None and not all(isinstance(n, str) for n in names):
        raise _bad(path, "class_names holds a non-string")
    if names is not None and "num_classes" in data and len(names) != data["num_classes"]:
        raise _bad(path, f"{len(names)} class_names for num_classes {data['num_classes']}")
    for key in ("mean", "std"):
        value = data.get(key)
        if value is not None and (len(value) != 3 or not all(
                isinstance(v, _NUMBER) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
            raise _bad(path, f"{key} is {value!r}, expected 3 finite numbers")
    return data


# config.yaml keys eval.py reads back to find and decode a run's test data
CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "img_size": (int,), "val_size": (int,), "seed": (int,), "max_train_images": (int, type(None)),
    "max_test_images": (int, type(None)), "epochs": (int,), "data_dir": (str, type(None)),
    "cache_dir": (str, type(None)),
}


def read_config(path: str | Path) -> dict:
    """The recipe in ``path`` (a run's config.yaml) as a mapping, read by YAML's safe loader, the keys eval.py
    uses type-checked (``img_size`` a positive int, ...); malformed YAML, a list or a wrong type -> ValueError."""
    import yaml

    path = Path(path)

    def bad(what: str) -> ValueError:
        return ValueError(f"{path} is damaged ({what}); restore it: it is the run's recipe, as train.py "
                          "--print-config writes one")

    try:
        data = yaml.safe_load(path.read_text())
    except UnicodeDecodeError:
        raise bad("not text") from None
    except yaml.YAMLError as err:
        raise bad(f"not YAML: {str(err).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise bad(f"a YAML {type(data).__name__}, not a mapping of recipe keys")
    for key, types in CONFIG_TYPES.items():
        value = data.get(key)
        if key in data and (not isinstance(value, types) or isinstance(value, bool)
                            or isinstance(value, int) and not 0 <= value < 2**63
                            or key == "img_size" and value < 1):
            raise bad(f"{key} is {value!r}, expected {' or '.join(t.__name__ for t in types)}"
                      f"{' >= 1' if key == 'img_size' else ''}")
    return data


def read_metrics(path: str | Path) -> tuple[list[str], list[dict[str, str]]]:
    """``(header, rows)`` of ``path`` (a run's metrics.csv): a header naming ``step``, and in every row a ``step``
    that is empty or a whole number and as many fields as the header; a short last row (an append cut off by a
    kill) is left out."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            keys, rows = list(reader.fieldnames or []), list(reader)
    except (UnicodeDecodeError, csv.Error) as err:
        raise _bad(path, f"not a CSV table: {err}") from None
    if rows and None in rows[-1].values() and None not in rows[-1]:
        rows = rows[:-1]
    if "step" not in keys:
        raise _bad(path, f"no step column in its header {keys[:5]}")
    for line, row in enumerate(rows, start=2):
        if None in row or None in row.values():
            raise _bad(path, f"line {line} has {'more' if None in row else 'fewer'} fields than the header")
        step = row["step"]
        try:
            ok = step == "" or float(step) == int(float(step)) >= 0
        except (ValueError, OverflowError):
            ok = False
        if not ok:
            raise _bad(path, f"line {line}: step {step!r} is not a whole number")
    return keys, rows
