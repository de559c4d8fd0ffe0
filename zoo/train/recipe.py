"""Training recipes: resolve one flat config from, lowest precedence first, the built-in defaults, the
model's ``configs/<model>.yaml``, a ``--config FILE``, ``--set key=value`` overrides (dotted keys into
``model_args`` / ``augment``, YAML-parsed values) and explicit command-line flags. Unknown keys raise a
ValueError naming the valid ones."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml

from .data.augment import DEFAULT_AUGMENT as AUGMENT_DEFAULTS

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
PRECISIONS = ("auto", "32", "bf16-mixed", "16-mixed")

DEFAULTS: dict = {
    # model and recipe
    "model": None,
    "model_args": {},          # keyword arguments of zoo.create_model (depth, drop_path_rate, ...)
    "epochs": 100,
    "batch_size": 128,
    "eval_batch_size": None,
    "lr": 1e-3,
    "weight_decay": 0.05,
    "warmup_epochs": 5,
    "min_lr_ratio": 0.01,
    "label_smoothing": 0.1,
    "augment": AUGMENT_DEFAULTS,
    # data
    "data_dir": None,
    "download": False,
    "img_size": 32,
    "val_size": 5000,
    "max_train_images": None,
    "max_test_images": None,
    "cache_dir": None,
    # hardware and run control
    "seed": 0,
    "precision": "auto",
    "accelerator": "auto",
    "devices": "auto",
    "strategy": "auto",
    "num_nodes": 1,
    "compile": False,
    "channels_last": "auto",
    "max_time": None,
    "limit_train_batches": None,
    "limit_val_batches": None,
    "limit_test_batches": None,
    "ckpt_every_n_steps": 500,
    "out": "runs",
    "resume": None,
    "init_from": None,
}
NESTED = {"augment": set(AUGMENT_DEFAULTS), "model_args": None}  # None: free-form (the model checks)


def _merge(cfg: dict, layer: dict, source: str) -> None:
    """Merge one layer into ``cfg`` in place; ``source`` names the layer in error messages."""
    for key, value in layer.items():
        if key not in DEFAULTS:
            raise ValueError(f"unknown config key {key!r} in {source}; valid keys: "
                             + ", ".join(sorted(DEFAULTS)))
        if key in NESTED and value is not None:
            if not isinstance(value, dict):
                raise ValueError(f"config key {key!r} in {source} must be a mapping, got {value!r}")
            valid = NESTED[key]
            unknown = set(value) - valid if valid is not None else set()
            if unknown:
                raise ValueError(f"unknown config key {key}.{sorted(unknown)[0]} in {source}; valid keys: "
                                 + ", ".join(f"{key}.{k}" for k in sorted(valid)))
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value


def load_yaml(path: str | Path) -> dict:
    """A YAML mapping from ``path``; a missing / malformed file -> ValueError."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ValueError(f"cannot read config file {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"config file {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def parse_set(items: list[str] | tuple[str, ...]) -> dict:
    """``["lr=3e-4", "augment.mixup_alpha=0.2"]`` -> ``{"lr": 3e-4, "augment": {"mixup_alpha": 0.2}}``."""
    layer: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        value = yaml.safe_load(raw) if raw.strip() else None
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string
            try:
                value = float(value)
            except ValueError:
                pass
        *parents, leaf = key.strip().split(".")
        node = layer
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return layer


def model_config_path(model: str) -> Path:
    return CONFIG_DIR / f"{model}.yaml"


def resolve_config(model: str | None = None, config_file: str | Path | None = None, overrides=(),
                   flags: dict | None = None) -> dict:
    """The fully resolved flat config. ``flags`` holds explicit command-line values (None = not given)."""
    from ..models import list_models

    file_layer = load_yaml(config_file) if config_file else {}
    set_layer = parse_set(list(overrides))
    flag_layer = {k: v for k, v in (flags or {}).items() if v is not None}
    model = model or set_layer.get("model") or file_layer.get("model")
    if model is None:
        raise ValueError("no model given: pass --model NAME (one of " + ", ".join(list_models()) + ")")
    if model not in list_models():
        from ..models import create_model
        create_model(model)  # raises the registry's ValueError with close matches

    cfg = copy.deepcopy(DEFAULTS)
    model_file = model_config_path(model)
    if model_file.is_file():
        _merge(cfg, load_yaml(model_file), str(model_file))
    _merge(cfg, file_layer, str(config_file))
    _merge(cfg, set_layer, "--set")
    _merge(cfg, flag_layer, "flags")
    cfg["model"] = model
    validate(cfg)
    return cfg


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


def validate(cfg: dict) -> None:
    """Type / range checks a user can get wrong; ValueError naming the key, expected and given."""
    if str(cfg["precision"]) not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {cfg['precision']!r}")
    cfg["precision"] = str(cfg["precision"])
    for key in ("epochs", "batch_size", "ckpt_every_n_steps", "num_nodes"):
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
            raise ValueError(f"{key} must be a positive integer, got {cfg[key]!r}")
    for key in ("lr", "weight_decay", "warmup_epochs", "min_lr_ratio", "label_smoothing"):
        if not isinstance(cfg[key], (int, float)) or cfg[key] < 0:
            raise ValueError(f"{key} must be a non-negative number, got {cfg[key]!r}")
    for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches"):
        cfg[key] = parse_limit(cfg[key])
    if cfg["max_time"] is not None:
        parse_max_time(cfg["max_time"])
    if cfg["channels_last"] not in ("auto", True, False):
        raise ValueError(f"channels_last must be auto, true or false, got {cfg['channels_last']!r}")
    if isinstance(cfg["devices"], str) and cfg["devices"] != "auto":
        cfg["devices"] = int(cfg["devices"]) if cfg["devices"].isdigit() else cfg["devices"]


def dump(cfg: dict) -> str:
    """The config as YAML text (what config.yaml in a run directory holds)."""
    return yaml.safe_dump(cfg, sort_keys=False)
