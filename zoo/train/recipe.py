"""Training recipes: one typed configuration, ``Recipe`` (augmentation in ``AugmentConfig``), and the only place a
setting is described: each field holds its type, default, doc line and check (``zoo.train.checks``); train.py's
flags and --help, config files, ``--set`` and a run's config.yaml all derive from the fields.

Resolution, lowest precedence first: the defaults, ``zoo/configs/<model>.yaml`` (every registered model ships one),
``--config FILE``, ``--set key=value`` and explicit flags; dotted keys reach into ``augment`` and ``model_args``
(checked against the model's constructor), whose mappings merge key by key. One safe YAML reader (``parse_yaml``: a
tag that would build a Python object is an error; numbers as in YAML 1.2: ``3e-4`` a float, ``1:00:00:00`` text)
reads config files and ``--set`` values. Errors are one-line ValueErrors naming the key, what was expected and what
was given; an unknown key names its layer and the valid keys. ``Recipe.to_yaml()`` loads back to an equal recipe."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import torch
import yaml

from ..data import DEFAULT_AUGMENT
from ..models.tta import TTA_LEVELS
from . import checks as c
from .checks import COUNT, FLAG, NATURAL, NUMBER, OPTIONAL_PATH, OPTIONAL_TEXT, PATH, POSITIVE, TEXT
from .distill import DISTILL_KINDS
from .metrics import logger_names
from .optim import MUON_DTYPES, OPTIMIZERS, SCHEDULES

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"   # zoo/configs, shipped in the wheel


def setting(default, doc: str, check: c.Check, **meta):
    """A recipe field: its doc line and check in ``metadata`` (``nested``: a mapping merged key by key, ``flag``: the
    command-line name where it is not the key's); every instance gets its own copy of the default."""
    make = default if isinstance(default, type) else lambda: copy.deepcopy(default)
    return field(default_factory=make, metadata={"doc": doc, "check": check, **meta})


class _Checked:
    """Construction runs every field's check and stores the normalised value (the dataclasses are frozen)."""

    prefix: ClassVar[str] = ""

    def __post_init__(self):
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](self.prefix + f.name, getattr(self, f.name)))

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "the recipe"):
        """An instance from a (partial) mapping of its keys (absent ones take their defaults); an unknown key's
        error names ``source``."""
        _check_keys(cls, data, source, cls.prefix)
        return cls(**data)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class AugmentConfig(_Checked):
    """Batched on-device training augmentation (``zoo.data``, whose ``DEFAULT_AUGMENT`` are the defaults)."""

    prefix: ClassVar[str] = "augment."
    crop_padding: int = setting(DEFAULT_AUGMENT["crop_padding"], "zero padding (pixels) before the random crop",
                                NATURAL)
    hflip: bool = setting(DEFAULT_AUGMENT["hflip"], "random horizontal flip", FLAG)
    alternating_flip: bool = setting(DEFAULT_AUGMENT["alternating_flip"], "with hflip: mirror each image in "
                                     "alternate epochs (airbench)", FLAG)
    randaugment: dict | bool | None = setting(DEFAULT_AUGMENT["randaugment"], "RandAugment: null (off), true or "
                                              "{num_ops: 2, magnitude: 9}", c.optional(c.RANDAUGMENT))
    mixup_alpha: float = setting(DEFAULT_AUGMENT["mixup_alpha"], "mixup Beta(alpha, alpha); 0 = off", NUMBER)
    cutmix_alpha: float = setting(DEFAULT_AUGMENT["cutmix_alpha"], "cutmix Beta(alpha, alpha); 0 = off", NUMBER)
    cutout: int = setting(DEFAULT_AUGMENT["cutout"], "side (pixels) of a zeroed square per image; 0 = off", NATURAL)


def _section(key: str, value) -> AugmentConfig:
    return value if isinstance(value, AugmentConfig) else AugmentConfig.from_dict(c.MAPPING(key, value or {}))


@dataclass(frozen=True)
class Recipe(_Checked):
    """Everything one training run needs; the keys of configs/*.yaml, --set, the flags and a run's config.yaml."""

    model: str | None = setting(None, "registered model name (train.py --list-models)", OPTIONAL_TEXT)
    model_args: dict = setting({}, "keyword arguments of zoo.create_model (depth, drop_path_rate, ...)",
                               c.MAPPING, nested=dict)
    epochs: int = setting(100, "training epochs (the LR schedule spans them)", POSITIVE)
    batch_size: int = setting(128, "global training batch size, split across devices and nodes", POSITIVE)
    eval_batch_size: int | None = setting(None, "validation / test batch size (null: batch_size)", COUNT)
    optimizer: str = setting("adamw", "adamw, sgd, muon (2-D; AdamW on the rest), muon_conv",
                             c.choice(OPTIMIZERS))
    muon_dtype: str = setting("auto", "dtype of Muon's iteration: auto (bfloat16 where the device computes it "
                              "natively, else float32), float32 or bfloat16", c.choice(("auto", *MUON_DTYPES)))
    lr: float = setting(1e-3, "peak learning rate", c.ABOVE_ZERO)
    momentum: float = setting(0.9, "SGD's / Muon's Nesterov momentum", NUMBER)
    weight_decay: float = setting(0.05, "weight decay (not on norms, biases, position embeddings)", NUMBER)
    no_decay_lr_scale: float = setting(1.0, "learning-rate multiplier of norms, biases and position tables", NUMBER)
    schedule: str = setting("cosine", "decay after the warm-up: cosine or linear", c.choice(SCHEDULES))
    warmup_epochs: float = setting(5.0, "linear warm-up, in epochs (fractions allowed)", NUMBER)
    min_lr_ratio: float = setting(0.01, "the decay ends at lr * min_lr_ratio", NUMBER)
    label_smoothing: float = setting(0.1, "cross-entropy label smoothing, in [0, 1)", c.UNIT_INTERVAL)
    fit_whitening: bool = setting(True, "patch-whitening filters from training images (false: random ones)", FLAG)
    ema_decay: float = setting(0.0, "EMA of the weights (decay warming up to this); 0 = off", c.UNIT_INTERVAL)
    tta: int = setting(0, "test-time augmentation of validation and test: 0 none, 1 mirror, 2 mirror + shifts",
                       c.choice(TTA_LEVELS))
    augment: AugmentConfig = setting(AugmentConfig, "training augmentation", _section, nested=AugmentConfig)
    data_dir: str | None = setting(None, "ImageFolder tree with train/ and test/, or a folder holding "
                                   "cifar-10-batches-py (null: ./data)", OPTIONAL_PATH)
    download: bool = setting(False, "download CIFAR-10 into data_dir when it holds no dataset", FLAG)
    img_size: int = setting(32, "images are img_size x img_size; every zoo model gets it", POSITIVE)
    low_res_size: int | None = setting(
        None, "progressive resizing: the first low_res_until of the training steps see images resized to this, "
        "the rest img_size (null: off); the model must take it (a ViT: model_args.dynamic_img_size: true)", COUNT)
    low_res_until: float = setting(0.75, "with low_res_size: the share of the training steps at that size, in (0, 1]",
                                   c.FRACTION)
    val_size: int = setting(5000, "training images held out for validation", NATURAL)
    max_train_images: int | None = setting(None, "train on a seeded subset of this many images", COUNT)
    max_test_images: int | None = setting(None, "test on a seeded subset of this many images", COUNT)
    cache_dir: str | None = setting(None, "where the decoded uint8 cache goes (null: $XDG_CACHE_HOME/zoo or "
                                    "~/.cache/zoo, never the data folder)", OPTIONAL_PATH)
    data_memory_budget: float | None = setting(
        None, "GiB of device memory the decoded images may take; above it batches stream from the memory-mapped "
        "cache file (null: half of the device's free memory)", c.optional(NUMBER))
    seed: int = setting(0, "seeds the split, the subsets, the shuffling and the weights", c.SEED)
    precision: str = setting("auto", "auto (GPU: bf16-mixed or 16-mixed; CPU: bf16-mixed with native bf16 where "
                             "measured faster, else 32), 32, bf16-mixed or 16-mixed", c.PRECISION)
    accelerator: str = setting("auto", "auto, cpu, gpu or mps (Apple silicon)", TEXT)
    devices: int | str = setting("auto", "device count (-1: all), a device list like 0,1, or auto", c.DEVICES)
    strategy: str = setting("auto", "Fabric's strategy: auto, ddp, ...", TEXT)
    num_nodes: int = setting(1, "machines in a multi-node run", POSITIVE)
    compile: bool | str = setting(False, "torch.compile the whole model (true), each CBAM and transformer block "
                                  "(regions), the training step's forward, loss and backward (step: CUDA graphs "
                                  "on CUDA), or not (false)", c.flag("regions", "step"))
    channels_last: str | bool = setting("auto", "channels-last memory (auto: resnet*, hybrid*)", c.flag("auto"))
    max_time: str | None = setting(None, "wall-clock budget DD:HH:MM:SS, above zero; the LR schedule is fitted to "
                                   "it", c.optional(c.max_time_check))
    limit_train_batches: int | float | None = setting(None, "batches per epoch (2) or a fraction (0.25)", c.limit_check)
    limit_val_batches: int | float | None = setting(None, "as limit_train_batches, for validation", c.limit_check)
    limit_test_batches: int | float | None = setting(None, "as limit_train_batches, for the test", c.limit_check)
    ckpt_every_n_steps: int = setting(500, "also write checkpoints/last.ckpt every N optimizer steps", POSITIVE)
    ckpt_every_minutes: float = setting(2.0, "write checkpoints/last.ckpt every this many minutes of training and at "
                                        "the end (0: only at the end and every N steps)", c.MINUTES)
    out: str = setting("runs", "root of run directories: the run is written to OUT/<model>/<run-id>/", PATH)
    loggers: list = setting([], "Lightning's loggers beside metrics.csv (always written): tensorboard (into "
                            "RUN/tensorboard/), wandb, mlflow, comet; repeatable or comma-separated", logger_names,
                            flag="logger")
    resume: str | None = setting(None, "continue a run directory / checkpoint of the same model and model "
                                 "arguments, or (auto) the newest run of the model under out", OPTIONAL_PATH)
    init_from: str | None = setting(None, "start a new run from a zoo checkpoint or a timm ViT state_dict",
                                    OPTIONAL_PATH)
    init_partial: bool = setting(False, "let init_from load under half of the model's parameter elements", FLAG)
    teacher: str | None = setting(None, "distil from a frozen teacher as DeiT does: pretrained:NAME, a run directory "
                                  "or a checkpoint (null: none)", OPTIONAL_PATH)
    distill: str = setting("hard", "with a teacher: hard (its top class, DeiT) or soft (KL at distill_temperature)",
                           c.choice(DISTILL_KINDS))
    distill_weight: float = setting(0.5, "with a teacher: its term's share of the loss, in [0, 1]",
                                    c.chain(NUMBER, c.rule("lie in [0, 1]", lambda v: 0 <= v <= 1)))
    distill_temperature: float = setting(1.0, "with distill: soft, the softmax temperature", c.ABOVE_ZERO)

    def __post_init__(self):
        from ..models import check_model_args, list_models  # the models load on first use

        super().__post_init__()
        for key in ("cutout", "crop_padding"):  # more than the image is a blank square or a crop of padding alone
            if getattr(self.augment, key) > self.img_size:
                raise ValueError(f"augment.{key} must be at most img_size ({self.img_size}), got "
                                 f"{getattr(self.augment, key)}")
        for key in ("no_decay_lr_scale", "weight_decay"):  # the optimizer multiplies them in float32
            if self.lr * getattr(self, key) > c.FLOAT32_MAX:
                raise ValueError(f"lr * {key} must be at most {c.FLOAT32_MAX:.4g} (float32's largest, which the "
                                 f"optimizer computes in), got {self.lr} * {getattr(self, key)}")
        self._check_batch_fits()
        if self.low_res_size is not None and self.low_res_size >= self.img_size:
            raise ValueError(f"low_res_size must be below img_size ({self.img_size}), got {self.low_res_size}")
        if self.model in list_models():
            check_model_args(self.model, self.model_args, prefix="model_args.")
        for key, instead in (("num_classes", "the data's classes set it"), ("img_size", "give img_size, which the "
                                                                             "data and the model share")):
            if key in self.model_args:  # a constructor argument the run sets itself
                raise ValueError(f"model_args.{key} is not a recipe setting: {instead}")
        if self.model in list_models():
            _check_model_fits(self.model, self.img_size, self.model_args)
            if self.low_res_size is not None:
                _check_takes_low_res(self.model, self.img_size, self.model_args, self.low_res_size)

    def _check_batch_fits(self) -> None:
        """One training batch (of batch_size images, or all of max_train_images where fewer) in float32 must fit
        in this machine's memory: img_size=100000 is refused here, not by the allocator after the decode."""
        from ..models.registry import host_memory_bytes

        batch = min(self.batch_size, self.max_train_images or self.batch_size)
        need, memory = batch * 3 * self.img_size**2 * 4, host_memory_bytes()
        if memory and need > memory:
            raise ValueError(f"a batch of {batch:,} images of img_size {self.img_size} takes {need / 2**30:,.0f} "
                             f"GiB in float32, more than this machine's {memory / 2**30:,.0f} GiB of memory: lower "
                             "img_size or batch_size")

    @classmethod
    def from_yaml(cls, path: str | Path) -> Recipe:
        """A recipe from a YAML file, e.g. a run's config.yaml."""
        return cls.from_dict(load_yaml(path), str(path))

    def to_yaml(self) -> str:
        """The recipe as YAML text (what config.yaml in a run directory holds)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


_FITTING: set[str] = set()  # the (model, img_size, model_args) already built on the meta device


def _check_model_fits(model: str, img_size: int, model_args: dict) -> None:
    """``zoo.models.check_model_fits`` with ``model_args.`` before the names, once per setting (a recipe is built
    several times while it is resolved)."""
    from ..models import check_model_fits

    key = json.dumps([model, img_size, model_args], sort_keys=True, default=repr)
    if key not in _FITTING:
        try:
            check_model_fits(model, img_size=img_size, **model_args)
        except ValueError as err:  # the constructor names its argument without the section
            message = str(err)
            raise ValueError(f"model_args.{message}" if message.split()[0] in model_args else message) from None
        _FITTING.add(key)


def _check_takes_low_res(model: str, img_size: int, model_args: dict, size: int) -> None:
    """``step.check_takes_size`` on the model built on the meta device (no memory, no compute)."""
    from ..models import create_model
    from .step import check_takes_size

    with torch.device("meta"):
        built = create_model(model, img_size=img_size, **model_args)
    check_takes_size(built, model, size)


def recipe_fields(cls=Recipe, prefix: str = ""):
    """``(dotted key, field)`` of every setting, nested sections' settings in place of the section."""
    for f in fields(cls):
        if isinstance(f.metadata.get("nested"), type) and f.metadata["nested"] is not dict:
            yield from recipe_fields(f.metadata["nested"], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f


def _check_keys(cls, layer: Mapping, source: str, prefix: str = "") -> None:
    """Unknown keys in one layer (and in its nested sections) -> ValueError naming the valid ones."""
    by_name = {f.name: f for f in fields(cls)}
    for key, value in layer.items():
        if key not in by_name:
            valid = ", ".join(prefix + name for name in sorted(by_name))
            shown = f"{prefix}{key}" if prefix else repr(key)
            raise ValueError(f"unknown config key {shown} in {source}; valid keys: {valid}")
        nested = by_name[key].metadata.get("nested")
        if nested and value is not None and not isinstance(value, (Mapping, nested)):
            raise ValueError(f"config key {prefix + key!r} in {source} must be a mapping, got {value!r}")
        if nested not in (None, dict) and isinstance(value, Mapping):
            _check_keys(nested, value, source, f"{prefix}{key}.")


class _SafeLoader(yaml.SafeLoader):
    """YAML's safe loader (no tags that build Python objects) with YAML 1.2's numbers: ``3e-4`` is a float, and
    ``1:00:00:00`` (a day's budget) a string, not YAML 1.1's base-60 integer 216000."""

    yaml_implicit_resolvers = {first: [(tag, re.compile("(?!.*:)" + regexp.pattern, regexp.flags)  # no base 60
                                        if tag.endswith(("int", "float")) else regexp) for tag, regexp in resolvers]
                               for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


_SafeLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                  list("-+.0123456789"))


def parse_yaml(text: str, source: str):
    """``text`` parsed by ``_SafeLoader``; malformed -> ValueError saying ``source`` is not valid YAML, in one line."""
    try:
        return yaml.load(text, Loader=_SafeLoader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as err:
        raise ValueError(f"{source} is not valid YAML: {str(err).splitlines()[0]}") from None


def load_yaml(path: str | Path) -> dict:
    """A YAML mapping from ``path``; a missing / malformed file -> ValueError."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"cannot read config file {path}: {err.strerror}") from None
    data = parse_yaml(text, f"config file {path}")
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    return data or {}


def nest(flat: Mapping) -> dict:
    """``{"augment.mixup_alpha": 0.2}`` -> ``{"augment": {"mixup_alpha": 0.2}}``."""
    layer: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.strip().split(".")
        node = layer
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return layer


def parse_set(items: list[str] | tuple[str, ...]) -> dict:
    """``["lr=3e-4", "augment.mixup_alpha=0.2"]`` -> ``{"lr": 3e-4, "augment": {"mixup_alpha": 0.2}}``."""
    flat = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        flat[key] = parse_yaml(raw, f"--set {key.strip()}={raw}") if raw.strip() else None
    return nest(flat)


def config_path(path: str | Path) -> Path:
    """``path``; where no such file exists but the package ships a recipe of that name (``configs/cpu_budget.yaml``,
    ``cpu_budget``), the shipped one: the documented commands also work from an installed wheel, in any folder."""
    given = Path(path).expanduser()
    shipped = CONFIG_DIR / (given.name if given.suffix else given.name + ".yaml")
    return shipped if not given.exists() and shipped.is_file() else given


def resolve_config(model: str | None = None, config_file: str | Path | None = None, overrides=(),
                   flags: dict | None = None) -> Recipe:
    """The resolved recipe. ``flags`` holds explicit command-line values by (dotted) key, None = not given; the
    model comes from ``model``, else ``--set model=``, else the ``--config`` file."""
    from ..models import create_model, list_models

    config_file = config_path(config_file) if config_file else None
    file_layer = load_yaml(config_file) if config_file else {}
    set_layer = parse_set(list(overrides))
    model = model or set_layer.get("model") or file_layer.get("model")
    if model is None:
        raise ValueError("no model given: pass --model NAME (one of " + ", ".join(list_models()) + ")")
    if model not in list_models():
        create_model(model)  # raises the registry's ValueError with close matches
    model_file = CONFIG_DIR / f"{model}.yaml"
    if not model_file.is_file():
        raise ValueError(f"no recipe for model {model!r}: expected {model_file} (every registered model ships "
                         "zoo/configs/<model>.yaml)")
    merged, by_name = {}, {f.name: f for f in fields(Recipe)}
    for layer, source in ((load_yaml(model_file), str(model_file)), (file_layer, str(config_file)),
                          (set_layer, "--set"), (nest({k: v for k, v in (flags or {}).items() if v is not None}),
                                                 "flags")):
        _check_keys(Recipe, layer, source)
        for key, value in layer.items():
            nested = by_name[key].metadata.get("nested")
            merged[key] = {**merged.get(key, {}), **(value or {})} if nested else value
    return Recipe.from_dict({**merged, "model": model})
