"""Training recipes: one typed configuration (``Recipe``, with the augmentation in ``AugmentConfig``) whose
fields carry their type, default, check and a doc line in one place, and its resolution from layers, lowest
precedence first: the defaults, the model's ``zoo/configs/<model>.yaml`` (required: a registered model
without one is an error), a ``--config FILE``, ``--set key=value`` overrides (dotted keys into ``augment`` /
``model_args``, YAML-parsed values) and explicit command-line flags.

Conventions: the keys and nesting of a recipe are those of the YAML files (``val_size``, ``augment.mixup_alpha``,
``model_args.*`` for ``zoo.create_model``, checked against the model's constructor); a run's config.yaml is
``Recipe.to_yaml()`` and loads back to an equal recipe. Unknown keys raise a ValueError naming the layer and the
valid keys; a wrong type or range raises one naming the key, what was expected and what was given; a field's
``after`` check relates it to other fields (cutout within the image, model_args of the model). One YAML reader
(``parse_yaml``, safe: no tags that build Python objects) parses config files and ``--set`` values. Augmentation
defaults are ``zoo.train.data.DEFAULT_AUGMENT`` (defined there only)."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from .checks import (  # noqa: F401  (re-exported: the recipe's parsers)
    After,
    Check,
    choice_check,
    devices_check,
    flag_check,
    fraction_check,
    integer_check,
    limit_check,
    mapping_check,
    max_time_check,
    number_check,
    optional_check,
    parse_limit,
    parse_max_time,
    positive_check,
    precision_check,
    randaugment_check,
    text_check,
    unit_interval_check,
)
from .data import DEFAULT_AUGMENT
from .loggers import logger_names
from .optim import MUON_DTYPES, OPTIMIZERS, SCHEDULES
from .tta import TTA_LEVELS

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"   # zoo/configs, shipped in the wheel

def _model_arguments(key: str, value: dict, recipe) -> None:
    """model_args must be arguments of the recipe's model, of the types its constructor declares."""
    from ..models import check_model_args, list_models  # the models load on first use, as in resolve_config

    if recipe.model in list_models():
        check_model_args(recipe.model, value, prefix=f"{key}.")


def _cutout_fits(key: str, value: AugmentConfig, recipe) -> None:
    if value.cutout > recipe.img_size:
        raise ValueError(f"{key}.cutout must be at most img_size ({recipe.img_size}), got {value.cutout}")


def _field(default, doc: str, check: Check, after: After | None = None, **extra) -> Any:
    """A dataclass field with its doc line, check and ``after`` check (run once every field is checked, with
    the whole config) in ``metadata``; mutable defaults are copied."""
    metadata = {"doc": doc, "check": check, **({"after": after} if after else {}), **extra}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    if isinstance(default, type):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def _validate(config, prefix: str) -> None:
    """Run every field's check on a (frozen) dataclass instance, storing the normalised values, then the
    ``after`` checks that relate fields."""
    for f in fields(config):
        object.__setattr__(config, f.name, f.metadata["check"](prefix + f.name, getattr(config, f.name)))
    for f in fields(config):
        if "after" in f.metadata:
            f.metadata["after"](prefix + f.name, getattr(config, f.name), config)


@dataclass(frozen=True)
class AugmentConfig:
    """Batched on-device training augmentation (``zoo.train.data``); the recipe key ``augment``."""

    crop_padding: int = _field(DEFAULT_AUGMENT["crop_padding"], "zero padding (pixels) before the random crop",
                               integer_check(0))
    hflip: bool = _field(DEFAULT_AUGMENT["hflip"], "random horizontal flip", flag_check())
    alternating_flip: bool = _field(DEFAULT_AUGMENT["alternating_flip"],
                                    "with hflip: mirror each image in alternate epochs (airbench)", flag_check())
    randaugment: dict | bool | None = _field(DEFAULT_AUGMENT["randaugment"],
                                             "RandAugment: null (off), true or {num_ops: 2, magnitude: 9}",
                                             optional_check(randaugment_check))
    mixup_alpha: float = _field(DEFAULT_AUGMENT["mixup_alpha"], "mixup Beta(alpha, alpha); 0 = off", number_check)
    cutmix_alpha: float = _field(DEFAULT_AUGMENT["cutmix_alpha"], "cutmix Beta(alpha, alpha); 0 = off", number_check)
    cutout: int = _field(DEFAULT_AUGMENT["cutout"], "side (pixels) of a zeroed square per image; 0 = off",
                         integer_check(0))

    def __post_init__(self):
        _validate(self, "augment.")


def _section(key: str, value) -> AugmentConfig:
    if isinstance(value, AugmentConfig):
        return value
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a mapping, got {value!r}")
    return _build(AugmentConfig, value or {}, "the recipe", prefix=f"{key}.")


@dataclass(frozen=True)
class Recipe:
    """Everything one training run needs; the keys of configs/*.yaml, --set and a run's config.yaml."""

    # model and optimisation
    model: str | None = _field(None, "registered model name (zoo.list_models())", optional_check(text_check))
    model_args: dict = _field({}, "keyword arguments of zoo.create_model (depth, drop_path_rate, ...)", mapping_check,
                              _model_arguments, nested=True)
    epochs: int = _field(100, "training epochs (the LR schedule spans them)", integer_check(1))
    batch_size: int = _field(128, "global training batch size, split across devices and nodes", integer_check(1))
    eval_batch_size: int | None = _field(None, "validation / test batch size (null: batch_size)",
                                         optional_check(integer_check(1)))
    optimizer: str = _field("adamw", "adamw, sgd, muon (2-D; AdamW on the rest), muon_conv", choice_check(OPTIMIZERS))
    optimizer_min_speed: float | None = _field(
        None, "keep a Muon optimizer only if a training step with it runs at >= this fraction of AdamW's speed "
        "here (measured once per machine and model); else Muon on fewer tensors, else AdamW (null: always keep)",
        optional_check(fraction_check))
    muon_dtype: str = _field("auto", "dtype of Muon's iteration: auto (bfloat16 where the device computes it "
                             "natively, else float32), float32 or bfloat16", choice_check(("auto", *MUON_DTYPES)))
    lr: float = _field(1e-3, "peak learning rate", positive_check)
    momentum: float = _field(0.9, "SGD's / Muon's Nesterov momentum", number_check)
    weight_decay: float = _field(0.05, "weight decay (not on norms, biases, position embeddings)", number_check)
    no_decay_lr_scale: float = _field(1.0, "learning-rate multiplier of norms, biases and position tables",
                                      number_check)
    schedule: str = _field("cosine", "decay after the warm-up: cosine or linear", choice_check(SCHEDULES))
    warmup_epochs: float = _field(5.0, "linear warm-up, in epochs (fractions allowed)", number_check)
    min_lr_ratio: float = _field(0.01, "the decay ends at lr * min_lr_ratio", number_check)
    label_smoothing: float = _field(0.1, "cross-entropy label smoothing, in [0, 1)", unit_interval_check)
    fit_whitening: bool = _field(True, "patch-whitening filters from training images (false: fixed random ones)",
                                 flag_check())
    ema_decay: float = _field(0.0, "EMA of the weights (decay warming up to this); 0 = off", unit_interval_check)
    tta: int = _field(0, "test-time augmentation of validation and test: 0 none, 1 mirror, 2 mirror + shifts",
                      choice_check(TTA_LEVELS))
    augment: AugmentConfig = _field(AugmentConfig, "training augmentation (AugmentConfig)", _section, _cutout_fits,
                                    nested=True, section=AugmentConfig)
    # data
    data_dir: str | None = _field(None, "ImageFolder tree or folder holding cifar-10-batches-py (null: ./data)",
                                  optional_check(text_check))
    download: bool = _field(False, "download CIFAR-10 into data_dir when it holds no dataset", flag_check())
    img_size: int = _field(32, "images are img_size x img_size; every zoo model gets it", integer_check(1))
    val_size: int = _field(5000, "training images held out for validation", integer_check(0))
    max_train_images: int | None = _field(None, "train on a seeded subset of this many images",
                                          optional_check(integer_check(1)))
    max_test_images: int | None = _field(None, "test on a seeded subset of this many images",
                                         optional_check(integer_check(1)))
    cache_dir: str | None = _field(None, "where the decoded uint8 cache goes (null: beside the data or ~/.cache)",
                                   optional_check(text_check))
    data_memory_budget: float | None = _field(
        None, "GiB of device memory the decoded images may take; above it batches stream from the memory-mapped "
        "cache file (null: half of the device's free memory)", optional_check(number_check))
    # hardware and run control
    seed: int = _field(0, "seeds the split, the subsets, the shuffling and the weights", integer_check(0))
    precision: str = _field("auto", "auto, 32, bf16-mixed or 16-mixed", precision_check)
    accelerator: str = _field("auto", "auto, cpu, gpu or mps (Apple silicon)", text_check)
    devices: int | str = _field("auto", "number of devices, a device list or auto", devices_check)
    strategy: str = _field("auto", "Lightning strategy: auto, ddp, ...", text_check)
    num_nodes: int = _field(1, "machines in a multi-node run", integer_check(1))
    compile: bool | str = _field(False, "torch.compile: true (whole model), regions or false", flag_check("regions"))
    channels_last: str | bool = _field("auto", "channels-last memory (auto: resnet*, hybrid*)", flag_check("auto"))
    max_time: str | None = _field(None, "wall-clock budget DD:HH:MM:SS; the LR schedule is fitted to it",
                                  optional_check(max_time_check))
    limit_train_batches: int | float | None = _field(None, "batches (int) or fraction (float) of an epoch", limit_check)
    limit_val_batches: int | float | None = _field(None, "as limit_train_batches, for validation", limit_check)
    limit_test_batches: int | float | None = _field(None, "as limit_train_batches, for the test", limit_check)
    ckpt_every_n_steps: int = _field(500, "also write checkpoints/last.ckpt every N optimizer steps", integer_check(1))
    ckpt_every_minutes: float = _field(2.0, "write checkpoints/last.ckpt every this many minutes of training and "
                                       "at the end (0: only at the end and every N steps)", number_check)
    out: str = _field("runs", "root of run directories: OUT/<model>/<run-id>/", text_check)
    loggers: list = _field([], "Lightning loggers beside metrics.csv (always written): tensorboard, wandb, mlflow, "
                           "comet", logger_names)
    resume: str | None = _field(None, "auto, a run directory or a checkpoint to continue", optional_check(text_check))
    init_from: str | None = _field(None, "start from a zoo checkpoint or a timm ViT state_dict",
                                   optional_check(text_check))
    init_partial: bool = _field(False, "let init_from load under half of the model's parameter elements", flag_check())

    def __post_init__(self):
        _validate(self, "")

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "the recipe") -> Recipe:
        """A recipe from a (partial) mapping of recipe keys; absent keys take their defaults."""
        return _build(cls, data, source)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Recipe:
        """A recipe from a YAML file, e.g. a run's config.yaml."""
        return _build(cls, load_yaml(path), str(path))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_yaml(self) -> str:
        """The recipe as YAML text (what config.yaml in a run directory holds)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _check_keys(cls, layer: Mapping, source: str, prefix: str = "") -> None:
    """Unknown keys in one layer (and in its nested sections) -> ValueError naming the valid ones."""
    by_name = {f.name: f for f in fields(cls)}
    for key, value in layer.items():
        if key not in by_name:
            valid = ", ".join(prefix + name for name in sorted(by_name))
            shown = f"{prefix}{key}" if prefix else repr(key)
            raise ValueError(f"unknown config key {shown} in {source}; valid keys: {valid}")
        if by_name[key].metadata.get("nested") and value is not None:
            if not isinstance(value, Mapping):
                raise ValueError(f"config key {prefix + key!r} in {source} must be a mapping, got {value!r}")
            if "section" in by_name[key].metadata:
                _check_keys(by_name[key].metadata["section"], value, source, f"{prefix}{key}.")


def _build(cls, data: Mapping, source: str, prefix: str = ""):
    """``cls(**data)`` after checking the keys, nested sections built first (so errors name ``source``)."""
    _check_keys(cls, data, source, prefix)
    kwargs = dict(data)
    for f in fields(cls):
        section = f.metadata.get("section")
        if section is not None and isinstance(kwargs.get(f.name, MISSING), Mapping):
            kwargs[f.name] = _build(section, kwargs[f.name], source, f"{prefix}{f.name}.")
    return cls(**kwargs)


def _merge(merged: dict, layer: Mapping, source: str) -> None:
    """Layer ``layer`` over ``merged`` in place: nested mappings merge key by key, other values replace."""
    _check_keys(Recipe, layer, source)
    nested = {f.name for f in fields(Recipe) if f.metadata.get("nested")}
    for key, value in layer.items():
        if key in nested:
            merged[key] = {**merged.get(key, {}), **(value or {})}
        else:
            merged[key] = value


def recipe_help() -> str:
    """One line per recipe key with its default and doc line (the ``--help`` epilog of train.py)."""
    lines = []
    for cls, prefix in ((Recipe, ""), (AugmentConfig, "augment.")):
        for f in fields(cls):
            if f.metadata.get("section"):
                continue
            default = f.default if f.default is not MISSING else f.default_factory()
            lines.append(f"  {prefix + f.name:24} {f.metadata['doc']} (default: {json.dumps(default)})")
    return "\n".join(lines)


def parse_yaml(text: str, source: str):
    """``text`` parsed by YAML's safe loader (a tag that would build a Python object, ``!!python/...``, is an
    error); malformed -> ValueError saying ``source`` is not valid YAML, in one line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{source} is not valid YAML: {str(err).splitlines()[0]}") from None


def load_yaml(path: str | Path) -> dict:
    """A YAML mapping from ``path``; a missing / malformed file -> ValueError."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"cannot read config file {path}: {err.strerror}") from None
    data = parse_yaml(text, f"config file {path}")
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
        value = parse_yaml(raw, f"--set {key.strip()}={raw}") if raw.strip() else None
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
    """Where the recipe of a registered model lives: ``zoo/configs/<model>.yaml``."""
    return CONFIG_DIR / f"{model}.yaml"


def resolve_config(model: str | None = None, config_file: str | Path | None = None, overrides=(),
                   flags: dict | None = None) -> Recipe:
    """The resolved recipe. ``flags`` holds explicit command-line values (None = not given); the model comes
    from ``model``, else ``--set model=``, else the ``--config`` file."""
    from ..models import create_model, list_models

    file_layer = load_yaml(config_file) if config_file else {}
    set_layer = parse_set(list(overrides))
    flag_layer = {k: v for k, v in (flags or {}).items() if v is not None}
    model = model or set_layer.get("model") or file_layer.get("model")
    if model is None:
        raise ValueError("no model given: pass --model NAME (one of " + ", ".join(list_models()) + ")")
    if model not in list_models():
        create_model(model)  # raises the registry's ValueError with close matches
    model_file = model_config_path(model)
    if not model_file.is_file():
        raise ValueError(f"no recipe for model {model!r}: expected {model_file} (every registered model ships "
                         "zoo/configs/<model>.yaml)")

    merged: dict = {}
    for layer, source in ((load_yaml(model_file), str(model_file)), (file_layer, str(config_file)),
                          (set_layer, "--set"), (flag_layer, "flags")):
        _merge(merged, layer, source)
    return Recipe.from_dict({**merged, "model": model})
