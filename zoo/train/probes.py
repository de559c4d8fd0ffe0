"""Choices a run measures on this machine before it trains, each measured once per machine, torch, thread count and
model shape, then remembered in ``PRECISION_FILE`` in the cache directory (``remembered_choice``): a timing
near a tie could otherwise choose differently from run to run, and two runs with one seed would not be the same run.

- ``probe_precision``: fp32 or bf16-mixed, whichever trains the recipe's model faster (``--precision auto`` on a CPU
  with native bf16).
- ``probe_step_seconds``: the seconds of one training step of the run, for the estimate of its wall time printed
  before training (``progress.plan_lines``); timed at every run, not remembered.

Each times a few steps of at most ``PROBE_BATCH`` images (seconds, not minutes, on a 2-core CPU) and scales the
forward and backward passes to the run's batch; the optimizer's step does not depend on the batch."""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable, Collection
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..atomic import atomic_write_json, locked
from ..data.cache import user_cache_dir
from ..models import create_model
from ..runtime.machine import machine_name
from ..runtime.timing import interleaved_medians
from .optim import build_optimizer, param_groups
from .recipe import Recipe

PRECISION_FILE = "precision-choices.json"  # the remembered measurements, in the cache directory
PROBE_BATCH = 32  # images per timed step at most: passes at the run's batch are scaled from these


def faster_precision(model: nn.Module, x: torch.Tensor, precisions: tuple[str, ...], repeats: int = 2,
                     margin: float = 0.05) -> str:
    """Of CPU ``precisions`` ("32", "bf16-mixed"), the one in which forward + backward of a copy of ``model`` on
    the batch ``x`` runs faster: one untimed step each, then ``repeats`` timed steps each, alternating, compared
    by their medians (``interleaved_medians``). The first precision is kept unless another is faster by more than
    ``margin`` (a fraction of its time): a near tie is noise, and fp32 is the exact one. ``model`` itself is not
    touched (its BatchNorm statistics included)."""
    model = copy.deepcopy(model).train()

    def step(precision: str) -> Callable[[], None]:
        def run() -> None:
            with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
                out = model(x)
            out.float().sum().backward()
        return run

    seconds = interleaved_medians({p: step(p) for p in precisions}, repeats=repeats)
    fastest = min(precisions, key=seconds.__getitem__)
    return fastest if seconds[fastest] < (1 - margin) * seconds[precisions[0]] else precisions[0]


def remembered_choice(path: Path, key: str, choose: Callable[[], str],
                      allowed: Collection[str] | None = None) -> tuple[str, bool]:
    """``(choice, measured)``: the choice stored under ``key`` in the JSON file ``path``, else ``choose()``'s,
    stored there. ``--precision auto`` remembers its measurement this way, so two runs of one recipe on one machine
    train in the same precision. An unreadable file counts as empty; a stored value that is not a string or not
    one of ``allowed`` counts as missing (a warning, then measured again); an unwritable file is left alone. The
    update re-reads the file and replaces it atomically under a lock (``path`` + ".lock"), so runs that measure at
    the same time keep each other's entries."""
    stored = _read_choices(path).get(key)
    if isinstance(stored, str) and (allowed is None or stored in allowed):
        return stored, False
    if stored is not None:
        shown = f"one of {sorted(allowed)}" if allowed is not None else "a string"
        warnings.warn(f"{path}: the stored choice {stored!r} is not {shown} here; measuring again", stacklevel=3)
    chosen = choose()
    try:
        with locked(path.with_name(path.name + ".lock")):
            choices = _read_choices(path)
            choices[key] = chosen
            atomic_write_json(path, choices)
    except OSError:  # an unwritable cache folder costs a measurement next time, not the run
        pass
    return chosen, True


def _read_choices(path: Path) -> dict:
    try:
        choices = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return choices if isinstance(choices, dict) else {}


def model_args(recipe: Recipe) -> dict:
    """``create_model``'s keyword arguments for the recipe's model (every zoo model takes img_size)."""
    return {**recipe.model_args, "img_size": recipe.img_size}


def uses_channels_last(recipe: Recipe) -> bool:
    """The recipe's memory format; "auto": channels_last for the conv models (measured faster on CPU too)."""
    if recipe.channels_last == "auto":
        return recipe.model.startswith(("resnet", "hybrid"))
    return bool(recipe.channels_last)


def _probe_inputs(recipe: Recipe) -> tuple[torch.nn.Module, torch.Tensor]:
    """A new model of the recipe and a random batch of its size, at most ``PROBE_BATCH`` images, in the memory
    format the run uses."""
    model = create_model(recipe.model, **model_args(recipe))
    x = torch.randn(min(recipe.batch_size, PROBE_BATCH), getattr(model, "in_chans", 3), recipe.img_size,
                    recipe.img_size)
    if uses_channels_last(recipe):
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    return model, x


def _remembered(recipe: Recipe, what: list, measure: Callable[[], str], label: str,
                allowed: tuple[str, ...]) -> str:
    """``measure()``'s choice (one of ``allowed``), remembered under the recipe's model shape plus ``what``;
    printed with ``label``."""
    key = json.dumps([recipe.model, model_args(recipe), recipe.batch_size, uses_channels_last(recipe), *what,
                      machine_name(), torch.__version__, torch.get_num_threads()], sort_keys=True)
    path = (Path(recipe.cache_dir) if recipe.cache_dir else user_cache_dir()) / PRECISION_FILE

    def announced() -> str:
        print(f"{label}: measuring a few training steps of {recipe.model} on this CPU", flush=True)
        return measure()

    chosen, measured = remembered_choice(path, key, announced, allowed)
    when = "measured now" if measured else "measured before"
    print(f"{label}: {chosen} for {recipe.model} on this CPU ({when}; remembered in {path}, delete it to "
          "measure again)")
    return chosen


def probe_precision(recipe: Recipe, precisions: tuple[str, ...]) -> str:
    """Which of ``precisions`` trains the recipe's model faster on this CPU (``device.faster_precision``)."""
    return _remembered(recipe, [list(precisions)], lambda: faster_precision(*_probe_inputs(recipe), precisions),
                       "--precision auto", tuple(precisions))


def timed_step_seconds(model: torch.nn.Module, x: torch.Tensor, optimizers: dict[str, Callable],
                       precision: str, repeats: int = 5, batch_scale: float = 1.0) -> dict[str, float]:
    """Seconds of one whole training step with each optimizer (``optimizers[name](model)`` builds it): the median
    forward, cross-entropy and backward of a copy of ``model`` (the same work whatever the optimizer) plus the
    median of that optimizer's step alone, the steps interleaved, each on its own copy holding the same gradients.
    Timing the step apart keeps the forward + backward's run-to-run noise (a few per cent, as large as the
    differences sought) out of the comparison. ``precision``: "32" or "bf16-mixed" (CPU autocast);
    ``batch_scale``: the forward and backward's seconds are multiplied by it (a step of ``batch_scale`` times
    ``x``'s images)."""
    targets = torch.randint(0, 10, (x.shape[0],), generator=torch.Generator().manual_seed(0))
    trained = copy.deepcopy(model).train()

    def forward_backward() -> None:
        trained.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
            logits = trained(x)
        F.cross_entropy(logits.float(), targets % logits.shape[-1]).backward()

    passes = interleaved_medians({"forward_backward": forward_backward}, repeats=repeats)["forward_backward"]

    def step_of(build: Callable) -> Callable[[], None]:
        stepped = copy.deepcopy(trained)
        for mine, source in zip(stepped.parameters(), trained.parameters(), strict=True):
            mine.grad = None if source.grad is None else source.grad.clone()
        return build(stepped).step

    steps = interleaved_medians({name: step_of(build) for name, build in optimizers.items()}, repeats=repeats)
    return {name: passes * batch_scale + seconds for name, seconds in steps.items()}


def _optimizer_builder(recipe: Recipe, name: str, muon_dtype: str) -> Callable:
    """Builds optimizer ``name`` for a model as a run of ``recipe`` does (its groups, rates and Muon's head)."""
    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        groups = param_groups(model, recipe.lr, recipe.weight_decay, recipe.no_decay_lr_scale)
        head = {id(p) for p in model.get_classifier().parameters()}
        return build_optimizer(name, groups, recipe.lr, momentum=recipe.momentum, muon_exclude=head,
                               muon_dtype=muon_dtype)
    return make


def probe_step_seconds(recipe: Recipe, precision: str, muon_dtype: str) -> float:
    """Seconds of one training step of ``recipe`` (its batch, precision and optimizer) on this CPU, eager: two
    timed steps of at most ``PROBE_BATCH`` images after an untimed one, the forward and backward scaled to the
    run's batch (``timed_step_seconds``)."""
    model, x = _probe_inputs(recipe)
    print(f"timing {recipe.model}'s training step ({x.shape[0]} images, precision {precision}, optimizer "
          f"{recipe.optimizer}) to estimate the run")
    builds = {recipe.optimizer: _optimizer_builder(recipe, recipe.optimizer, muon_dtype)}
    return timed_step_seconds(model, x, builds, precision, repeats=2,
                              batch_scale=recipe.batch_size / x.shape[0])[recipe.optimizer]
