"""Training on Lightning Fabric: ``fit(recipe)`` is one run, top to bottom.

    fit(recipe)
      plan_run         every decision made once, before anything is written: the device and process count, the run
                       directory (a resumed one checked against the recipe and the data), the data decoded into the
                       cache, --init-from and --teacher checked, the precision (measured on a CPU with native bf16),
                       a step timed for the estimate
      Fabric           precision, devices, DDP (launched under torchrun or SLURM, or its own processes)
      train            the model, optimizer, schedule and EMA built from the recipe (and a resumed run's checkpoint
                       loaded); then step by step: augment, forward, backward, optimizer step, EMA, the next step's
                       rate, the clock; every epoch a validation (best.ckpt); last.ckpt every N steps, every few
                       minutes, at a signal and at the end
      test             the best checkpoint on the test split
      summary.json     and the run directory, printed last

A checkpoint holds everything the rest of a run depends on (``checkpoint_state``): the weights (the EMA's, and the
trained ones beside them), the optimizer, the schedule, where the loop and the data order stand, the epoch's totals
so far, the clock and the random generators, so a resumed run continues the uninterrupted one bit for bit and its
metrics.csv row for row. Under several processes rank 0's clock and any rank's signal decide for all ranks, at steps
all ranks reach together; rank 0 writes the files.

``fit(recipe, callbacks=[...])`` hands objects to Fabric's callbacks: the loop calls their ``on_train_start``,
``on_train_batch_start``, ``on_train_batch_end``, ``on_validation_batch_start``, ``on_test_batch_start`` and
``on_train_end`` with ``run`` (the ``Run``) where they have them."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import lightning
import torch
from lightning.fabric import Fabric
from torch import nn

from ..atomic import atomic_write_json
from ..data import ImageData
from ..data.cache import user_cache_dir
from ..data.samplers import split_batch
from ..layers.whitening import PatchWhitening
from ..models import compile_regions, create_model, model_info
from ..runtime.console import quiet_libraries
from ..runtime.device import compile_for, host_sync_every, resolve_accelerator, resolve_muon_dtype, resolve_precision
from ..runtime.distributed import (
    external_environment,
    is_global_zero,
    on_rank_zero,
    open_process_group,
    planned_world_size,
    rank_zero_first,
)
from ..runtime.machine import machine_name
from ..runtime.memory import keep_freed_memory
from ..runtime.random import forked_generators, random_states, set_random_states
from . import clock as timekeeping
from .checks import parse_max_time
from .clock import RunClock
from .compiled import CompiledStep, compile_cache_dir, inductor_cache_counts, use_compile_cache
from .distill import load_teacher
from .metrics import MetricsFile, build_loggers, require_loggers
from .optim import EMA, WarmupDecay, build_optimizer, param_groups, set_rates
from .preemption import Interrupted, Preempted, StopFlag, stops_at_once
from .probes import model_args, probe_precision, probe_step_seconds, uses_channels_last
from .progress import Progress, format_duration, plan_lines, step_seconds_text
from .recipe import Recipe
from .runs import (
    RunLock,
    check_resume_data,
    check_resume_weights,
    create_run_dir,
    find_run_dir,
    load_training_checkpoint,
    recorded_choice,
    remove_failed_run,
    save_checkpoint,
)
from .step import Totals, compiled_train_loss, eval_loss, low_res, train_loss
from .warmstart import init_from, match_init

WHITENING_IMAGES = 5000  # training images whose patches set the whitening filters (airbench uses 5,000)
FUSED_OPTIMIZER_DEVICES = ("cuda", "mps")  # one kernel per step there, and a GradScaler's inf check on the device
FABRIC_PRECISION = {"32": "32-true", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}
LOG_EVERY = 50  # optimizer steps between metrics.csv's step rows (or ckpt_every_n_steps, when fewer)


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN / inf loss; the message names the first bad optimizer step."""


# ---------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class RunPlan:
    """Every decision of a run, made once before anything is written (``plan_run``) and what the rest is built from:
    the recipe as resolved on this machine (its precision, muon_dtype and compile the ones chosen here), the device,
    the run directory and the checkpoint it resumes, and the time budget."""

    recipe: Recipe
    accelerator: str            # "cpu", "gpu" or "mps" ("auto" resolved)
    precision: str              # "32", "bf16-mixed" or "16-mixed" ("auto" resolved)
    run_dir: Path
    resume_from: Path | None    # checkpoints/last.ckpt of a resumed run, else None
    setup_s: float = 0.0        # seconds the run spent before its model was built (the precision probe)
    world_size: int = 1         # processes (devices x nodes)
    budget_s: float | None = None  # --max-time in seconds
    machine: str = ""           # the CPU or GPU the numbers come from (``machine.machine_name``)
    step_s: float | None = None  # a training step's seconds as the probes timed it before training (CPU), else None
    teacher: nn.Module | None = None  # the frozen teacher of ``teacher`` (``distill.load_teacher``), else None


def plan_run(recipe: Recipe) -> tuple[RunPlan, ImageData]:
    """The run's plan and its data (decoded by one process first: the data cache), every choice checked before
    anything is written: the device and process count, the run directory (a resumed one checked against the data),
    an ``init_from`` that must load, a teacher that can teach this run, and the precision and Muon dtype (a
    resumed run keeps the ones its config.yaml records; ``auto`` measured on a CPU with native bf16)."""
    accelerator = resolve_accelerator(recipe.accelerator, recipe.devices)
    require_loggers(recipe.loggers)
    world_size = planned_world_size(recipe.devices, recipe.num_nodes, accelerator)
    split_batch(recipe.batch_size, world_size)
    report_auto_devices(recipe, accelerator, world_size)
    open_process_group(accelerator)  # under torchrun / SLURM: rank 0 chooses the run directory for all ranks
    run_dir, resume_from, _ = on_rank_zero(lambda: find_run_dir(recipe))
    data = rank_zero_first(lambda: prepare_data(recipe))  # one process builds the data cache
    if resume_from is not None:
        check_resume_data(resume_from, data.num_classes, data.class_names)
        check_resume_weights(resume_from, create_model(recipe.model, num_classes=data.num_classes,
                                                       **model_args(recipe)))
    elif recipe.init_from:  # a refused --init-from fails before the precision probe's seconds
        match_init(create_model(recipe.model, num_classes=data.num_classes, **model_args(recipe)),
                   recipe.init_from, allow_partial=recipe.init_partial)
    teacher = load_teacher(recipe.teacher, data.num_classes, recipe.img_size) if recipe.teacher else None
    start = timekeeping.now()
    one_process = world_size == 1  # DDP ranks must not measure (and choose) apart
    precision, muon_dtype = recipe.precision, recipe.muon_dtype
    if resume_from is not None:  # a resumed run keeps the choices it started with (config.yaml records them)
        precision = recorded_choice(run_dir, "precision", precision, accelerator)
        muon_dtype = recorded_choice(run_dir, "muon_dtype", muon_dtype, accelerator)
    probed = replace(recipe, batch_size=min(recipe.batch_size, data.num_train_images))  # the largest step taken
    precision = resolve_precision(precision, accelerator,
                                  (lambda options: probe_precision(probed, options)) if one_process else None)
    muon_dtype = resolve_muon_dtype(muon_dtype, accelerator)
    step_s = None
    if one_process and accelerator == "cpu":  # the run's estimate, printed before its first step
        step_s = probe_step_seconds(probed, precision, muon_dtype)
    resolved = replace(recipe, precision=precision, muon_dtype=muon_dtype,
                       compile=compile_for(recipe.compile, accelerator))
    budget_s = parse_max_time(recipe.max_time) if recipe.max_time else None
    return RunPlan(resolved, accelerator, precision, run_dir, resume_from, timekeeping.now() - start, world_size,
                   budget_s, machine_name(accelerator), step_s, teacher), data


def report_auto_devices(recipe: Recipe, accelerator: str, world_size: int) -> None:
    """One line when ``devices: auto`` takes several GPUs of this machine (printed by rank 0 only)."""
    if recipe.devices == "auto" and accelerator == "gpu" and world_size > 1 and external_environment() is None \
            and is_global_zero():
        print(f"--devices auto: all {world_size} GPUs of this machine, one DDP process each; batch_size "
              f"{recipe.batch_size} is the global batch ({recipe.batch_size // world_size} per GPU)")


def prepare_data(recipe: Recipe) -> ImageData:
    """The run's data, found (or downloaded), decoded into the cache and read back."""
    data = ImageData(recipe.data_dir, download=recipe.download, img_size=recipe.img_size,
                     batch_size=recipe.batch_size, eval_batch_size=recipe.eval_batch_size, val_size=recipe.val_size,
                     seed=recipe.seed, augment=recipe.augment.to_dict(), cache_dir=recipe.cache_dir,
                     max_train_images=recipe.max_train_images, max_test_images=recipe.max_test_images,
                     memory_budget=recipe.data_memory_budget)
    if is_global_zero():  # the first line of a run: reading (or decoding) the data comes first
        print(f"{recipe.model}: reading the images of {data.data_dir}", flush=True)
    data.prepare_data()
    return data


# ---------------------------------------------------------------------------------------------------- a run


def fit(recipe: Recipe, callbacks: list | tuple = ()) -> Path:
    """Train one run from a resolved recipe (``zoo.train.recipe.resolve_config``) and return its run directory,
    which holds config.yaml, metrics.csv, checkpoints/{last,best}.ckpt and summary.json. With ``recipe.resume``
    ("auto" or a run directory / checkpoint) the run continues where its last.ckpt ends, once its model, model
    arguments, image size and classes are checked against the recipe and the data (nothing is written before).
    ``callbacks``: objects whose hooks the loop calls (see the module)."""
    quiet_libraries()
    keep_freed_memory()  # before the precision probe, which times steps as training will run them
    # SIGTERM, SIGUSR1 or Ctrl-C while the data are decoded or the probes run: nothing written yet; one line and
    # 128 + the signal, as in every later phase
    try:
        with stops_at_once("before training"):
            plan, data = plan_run(recipe)
    except Interrupted as stop:  # the line names the checkpoint a resume would continue (looked up only now)
        raise Interrupted(stop.signum, stop.when, resumed_checkpoint(recipe)) from None
    # the run directory is held by one process: a second one resuming it stops here in one line, before it
    # rewrites anything (a run refused earlier, for other data or another model, touched nothing)
    lock, created = RunLock(plan.run_dir) if is_global_zero() else None, None
    if lock is not None and plan.resume_from is not None:
        lock.acquire()
    try:
        created = on_rank_zero(lambda: create_run_dir(plan.recipe, plan.run_dir))
        if lock is not None and plan.resume_from is None:
            lock.acquire()
        return train_and_test(plan, data, callbacks)
    except BaseException:
        if lock is not None:  # a new run that failed before its first checkpoint leaves nothing behind
            lock.release()
            remove_failed_run(plan.run_dir, created)
        raise
    finally:
        if lock is not None:
            lock.release()


def resumed_checkpoint(recipe: Recipe) -> Path | None:
    """The checkpoint ``recipe.resume`` continues, if any (None where it names none, or is refused)."""
    try:
        return find_run_dir(recipe)[1] if recipe.resume else None
    except ValueError:
        return None


def make_fabric(plan: RunPlan, callbacks) -> Fabric:
    """Fabric for the plan's device, processes and precision, launched (under torchrun / SLURM it joins the open
    process group; with several devices and no launcher it starts the other processes, which run the same
    command, and find the run directory this one chose in ``runs.RUN_DIR_ENV``)."""
    r = plan.recipe
    fabric = Fabric(accelerator=plan.accelerator, devices=r.devices, num_nodes=r.num_nodes, strategy=r.strategy,
                    precision=FABRIC_PRECISION[plan.precision], callbacks=list(callbacks),
                    loggers=build_loggers(r.loggers, plan.run_dir))
    fabric.launch()
    return fabric


@dataclass
class Position:
    """Where training stands, as a checkpoint records it."""

    step: int = 0                       # optimizer steps taken
    epoch: int = 0                      # epochs finished
    batch: int = 0                      # batches of the current epoch trained
    best_val_top1: float | None = None  # the best validation top-1 so far (best.ckpt's)
    low_res_steps: int = 0              # progressive resizing: steps before the switch to full size (0: none)


@dataclass
class Run:
    """What the loop trains with, built by ``build_run``: the hooks of ``fit``'s callbacks receive it."""

    plan: RunPlan
    fabric: Fabric
    data: ImageData
    net: nn.Module                      # the model itself
    model: nn.Module                    # ``net`` as Fabric set it up (autocast; DDP under several processes)
    optimizer: torch.optim.Optimizer
    base_lrs: list[float]
    schedule: WarmupDecay
    ema: EMA | None
    clock: RunClock
    position: Position
    steps_per_epoch: int
    val_batches: int
    test_batches: int
    memory_format: torch.memory_format
    first_bad_step: torch.Tensor        # the first step whose loss was not finite (-1: none), on the device
    progress: Progress
    metrics: MetricsFile | None         # rank 0's
    totals: Totals                      # the training epoch's so far
    teacher: nn.Module | None = None    # on the run's device
    last_saved_step: int = -1           # the step of the last last.ckpt written
    refit_due: bool = False             # a step or validation time was measured: the budget is fitted again
    announced: bool = False             # the plan line was printed


def train_and_test(plan: RunPlan, data: ImageData, callbacks) -> Path:
    """Fit, test the best checkpoint and write summary.json; a new run that ends before its first optimizer
    step (a time budget too small for one) -> ValueError; a finished run resumed with nothing left to train keeps
    its test and summary.json."""
    fabric = make_fabric(plan, callbacks)
    fabric.seed_everything(plan.recipe.seed, workers=True, verbose=False)
    if plan.accelerator == "gpu":  # fp32 matmuls on tensor cores (TF32), as --precision 32 users of a GPU expect
        torch.set_float32_matmul_precision("high")
    start = timekeeping.now()
    compiling = start_compile_cache(plan)
    agree = (lambda any_rank: bool(fabric.all_reduce(torch.tensor(float(any_rank)), reduce_op="sum") > 0)) \
        if fabric.world_size > 1 else None
    data.setup(None, device=fabric.device, agree=agree)  # every split: the test runs after the fit
    run = build_run(plan, data, fabric, spent_s=plan.setup_s + timekeeping.now() - start)
    last = plan.run_dir / "checkpoints" / "last.ckpt"
    resumed_at = run.position.step
    train(run, last)
    if run.position.step == resumed_at and plan.resume_from and (plan.run_dir / "summary.json").is_file():
        print(f"the run had finished ({resumed_at} steps, {run.position.epoch} epochs): nothing to train, its "
              f"test and summary.json kept; give more --epochs to train it on")
        return plan.run_dir
    if run.position.step == 0:
        raise ValueError(f"training ended before its first optimizer step (--max-time {plan.recipe.max_time}, "
                         f"--limit-train-batches {plan.recipe.limit_train_batches}): nothing to save")
    with stops_at_once("during the final test", last):
        tested = test(run)
    if fabric.is_global_zero:
        summary = summarize(run, tested)
        atomic_write_json(plan.run_dir / "summary.json", {**summary, **compile_facts(run, compiling)})
        for logger in fabric.loggers:
            logger.finalize("success")
    return plan.run_dir


def start_compile_cache(plan: RunPlan) -> dict | None:
    """Where a compiling recipe's kernels are kept (``compiled.compile_cache_dir`` under the user cache folder,
    one per torch version, device and model / compile settings), and Inductor's cache counters now; None when
    the recipe compiles nothing."""
    r = plan.recipe
    if not r.compile:
        return None
    settings = {"model": r.model, "model_args": model_args(r), "compile": r.compile, "precision": plan.precision,
                "channels_last": uses_channels_last(r), "optimizer": r.optimizer, "muon_dtype": r.muon_dtype}
    folder = use_compile_cache(compile_cache_dir(user_cache_dir(), plan.accelerator, plan.machine, settings))
    return {"folder": folder, **inductor_cache_counts()}


def compile_facts(run: Run, compiling: dict | None) -> dict:
    """summary.json's compile keys: ``compile_s``, the seconds of the first training step under ``compile: step``
    (which compiles), and the Inductor cache's hits and misses in this process (a second run on the machine hits)."""
    if compiling is None:
        return {}
    counts = inductor_cache_counts()
    return {"compile_s": getattr(run.optimizer.optimizer, "compile_s", None),
            "compile_cache": str(compiling["folder"]), **{key: counts[key] - compiling[key] for key in counts}}


def batches_kept(total: int, limit: int | float | None) -> int:
    """The batches of a loader of ``total`` that a ``limit_*_batches`` setting keeps (a count or a fraction)."""
    if limit is None:
        return total
    return int(total * limit) if isinstance(limit, float) else min(total, limit)


def build_net(plan: RunPlan, data: ImageData) -> nn.Module:
    """The model of the recipe for the data's classes, in the recipe's memory format; a new run computes its
    patch-whitening filters (if the model has any) from the training images and loads ``init_from``; then the
    recipe's compilation (``regions``: each CBAM and transformer block; true: the whole model)."""
    r = plan.recipe
    net = create_model(r.model, num_classes=data.num_classes, **model_args(r))
    if uses_channels_last(r):
        net.to(memory_format=torch.channels_last)
    whitening = [m for m in net.modules() if isinstance(m, PatchWhitening)]
    if plan.resume_from is None and whitening and r.fit_whitening:  # fit_whitening=false: random filters
        images = data.normalize(data.train_dataset[:WHITENING_IMAGES][0])  # read alone when streamed
        if is_global_zero():
            print(f"fitting the patch-whitening filters to {len(images):,} training images")
        with torch.no_grad():
            for layer in whitening:
                layer.fit(images.to(layer.weight.device))
    if r.init_from and plan.resume_from is None:
        report = init_from(net, r.init_from, allow_partial=r.init_partial)
        if is_global_zero():
            print(report.summary())
    if r.compile == "regions":
        compile_regions(net)
    elif r.compile and r.compile != "step":
        net.compile()
    return net


def build_optimizer_for(plan: RunPlan, net: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The recipe's optimizer over ``net`` (on ``device``): timm's two parameter groups (no decay on norms, biases
    and the model's ``no_weight_decay()``), Muon's matrices without the classifier (timm's ``get_classifier``),
    fused where the device has it; under ``compile: step`` the rates are device tensors and the step compiled
    (``CompiledStep``)."""
    r = plan.recipe
    groups = param_groups(net, r.lr, r.weight_decay, r.no_decay_lr_scale)
    compiled = r.compile == "step"
    optimizer = build_optimizer(r.optimizer, groups, r.lr, momentum=r.momentum,
                                fused=device.type in FUSED_OPTIMIZER_DEVICES,
                                muon_exclude={id(p) for p in net.get_classifier().parameters()},
                                muon_dtype=r.muon_dtype, compiled=compiled)
    if compiled:
        for group in optimizer.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]), device=device)
        optimizer = CompiledStep(optimizer)
    return optimizer


def build_run(plan: RunPlan, data: ImageData, fabric, spent_s: float) -> Run:
    """Model, optimizer, schedule, EMA and clock from the recipe, set up on Fabric; a resumed run's checkpoint
    loaded into them."""
    r = plan.recipe
    checkpoint = load_training_checkpoint(plan.resume_from) if plan.resume_from else None
    net = build_net(plan, data)
    if checkpoint is not None:
        net.load_state_dict(strip_prefix(checkpoint.get("trained_state_dict") or checkpoint["state_dict"]))
    model = fabric.setup_module(net)
    optimizer = build_optimizer_for(plan, net, fabric.device)
    base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
    optimizer = fabric.setup_optimizers(optimizer)
    steps_per_epoch = batches_kept(len(data.train_dataloader()), r.limit_train_batches)
    if steps_per_epoch == 0:
        raise ValueError(f"--limit-train-batches {r.limit_train_batches} keeps no training batch")
    scheduled = steps_per_epoch * r.epochs
    warmup_frac = min(r.warmup_epochs / max(r.epochs, 1), 1.0)
    schedule = WarmupDecay(round(scheduled * warmup_frac), scheduled, r.min_lr_ratio, r.schedule)
    ema = EMA(net, r.ema_decay) if r.ema_decay else None
    passes = {0: 1, 1: 2, 2: 6}[r.tta]
    val_batches = batches_kept(len(data.val_dataloader()), r.limit_val_batches)
    test_batches = batches_kept(len(data.test_dataloader()), r.limit_test_batches)
    clock = RunClock(budget_s=plan.budget_s, scheduled_steps=scheduled, steps_per_epoch=steps_per_epoch,
                     val_batches=val_batches, eval_passes=passes,
                     low_res_cost=(r.img_size / r.low_res_size) ** 2 if r.low_res_size else 1.0,
                     low_res_until=r.low_res_until if r.low_res_size else 0.0, step_s=plan.step_s)
    position = Position(low_res_steps=round(scheduled * r.low_res_until) if r.low_res_size else 0)
    totals = Totals(data.num_classes, fabric.device)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        if ema is not None:
            ema.load_state_dict({"averaged": strip_prefix(checkpoint["state_dict"]), "count": checkpoint["ema_count"]})
        schedule.warmup_steps, schedule.total_steps = checkpoint["schedule"]
        position = Position(**checkpoint["loop"])
        clock.load_state_dict(checkpoint["clock"])
        data.load_order_state(checkpoint["data_order"])
        if checkpoint["epoch_totals"] is not None:
            totals.load_state_dict(checkpoint["epoch_totals"])
    clock.start(position.step, spent_s)
    progress = Progress(fabric.is_global_zero, refresh_every=1 if plan.accelerator == "cpu" else 20)
    metrics = MetricsFile(plan.run_dir / "metrics.csv", position.step if checkpoint is not None else None) \
        if fabric.is_global_zero else None
    run = Run(plan, fabric, data, net, model, optimizer, base_lrs, schedule, ema, clock, position, steps_per_epoch,
              val_batches, test_batches, torch.channels_last if uses_channels_last(r) else torch.contiguous_format,
              torch.tensor(-1, dtype=torch.long, device=fabric.device), progress, metrics, totals,
              fabric.to_device(plan.teacher) if plan.teacher is not None else None,
              last_saved_step=position.step if checkpoint is not None else -1)
    if checkpoint is not None:  # the generators as they were at the checkpoint: the next draw is the next step's
        set_random_states(checkpoint["random"])
    return run


def strip_prefix(state_dict: dict) -> dict:
    """A checkpoint's ``model.``-prefixed weights (the LightningModule's layout) as the model's own."""
    return {key.removeprefix("model."): value for key, value in state_dict.items() if key.startswith("model.")}


# ---------------------------------------------------------------------------------------------------- training


def train(run: Run, last: Path) -> None:
    """Train until the recipe's epochs or the budget's steps are done, or a signal stops the run (``Preempted``)."""
    fabric, position, clock, r = run.fabric, run.position, run.clock, run.plan.recipe
    compiled_step = isinstance(run.optimizer.optimizer, CompiledStep)
    forward = compiled_train_loss(fabric.device.type) if r.compile == "step" else train_loss
    if run.ema is not None and compiled_step:
        run.optimizer.optimizer.after_step.append(run.ema.update)  # the EMA joins the compiled step
    if run.plan.budget_s is not None and clock.step_times() is not None and clock.total_steps is not None:
        refit(run, clock.fit_steps(position.step, position.low_res_steps))  # resumed: what its budget buys now
    sync_rates(run)
    flag = StopFlag(last, forward=forwarder(fabric))
    every = host_sync_every(fabric.device.type)
    done = clock.total_steps is not None and position.step >= clock.total_steps
    with flag.installed():
        announce_model(run)
        announce_plan(run)
        fabric.call("on_train_start", run=run)
        run.progress.start(position.epoch, position.step, clock.run_steps(position.step, position.low_res_steps))
        while position.epoch < r.epochs and not done:
            run.data.epoch = position.epoch
            for images, labels in itertools.islice(run.data.train_dataloader(), run.steps_per_epoch - position.batch):
                fabric.call("on_train_batch_start", run=run)
                loss, logits, targets, rate = training_step(run, images, labels, forward)
                position.step += 1
                position.batch += 1
                if run.ema is not None and not compiled_step:
                    run.ema.update()
                clock.images += len(labels) * fabric.world_size
                run.totals.add(loss, logits, targets)
                run.first_bad_step.copy_(torch.where(~torch.isfinite(loss.detach()) & (run.first_bad_step < 0),
                                                     position.step, run.first_bad_step))
                if position.step % min(LOG_EVERY, r.ckpt_every_n_steps) == 0:
                    log(run, {"epoch": position.epoch, "step": position.step, "lr": rate,
                              "train/loss_step": loss.item()})
                run.refit_due |= clock.after_step(position.step, fabric.device, position.low_res_steps)
                if run.refit_due and not run.announced:  # no step was timed before training: now one is
                    announce_plan(run)
                show(run, loss)
                fabric.call("on_train_batch_end", run=run)
                epoch_end = position.batch == run.steps_per_epoch
                every_few = position.step % every == 0 or epoch_end  # a host sync on a GPU, a collective under DDP
                signum, timed = decide(run, flag, fabric.world_size == 1 or every_few, check_nan=every_few)
                budget_spent = clock.total_steps is not None and position.step >= clock.total_steps
                if epoch_end or budget_spent:  # the epoch's validation, also when a signal came at its last step
                    end_epoch(run)
                    run.refit_due &= not budget_spent  # the budget ended the run: its step count stays
                    signum = signum or decide(run, flag, True)[0]
                if not signum and (position.step % r.ckpt_every_n_steps == 0 or timed):
                    save_last(run, last)
                    signum = decide(run, flag, True)[0]  # a signal during the write: it is the stop's checkpoint
                if signum:
                    if run.last_saved_step != position.step:
                        save_last(run, last)
                    run.progress.close()
                    raise Preempted(signum, position.step, last)
                if budget_spent:
                    done = True
                    break
    run.progress.close()
    if run.last_saved_step != position.step and position.step > 0:
        save_last(run, last)
    clock.stop()
    fabric.call("on_train_end", run=run)


def training_step(run: Run, images: torch.Tensor, labels: torch.Tensor, forward):
    """One optimizer step on a batch: ``(loss, logits, targets, learning rate)``."""
    fabric, r, position = run.fabric, run.plan.recipe, run.position
    images, labels = fabric.to_device((images, labels))  # streamed batches come from host memory
    images, targets = run.data.augment(images, labels)
    rate = run.base_lrs[0] * run.schedule(position.step)  # this step's (set after the step before, or at the start)
    with rank_own_draws(run):
        teacher = None
        if run.teacher is not None:
            with torch.no_grad(), fabric.autocast():
                teacher = run.teacher(images)
        small = r.low_res_size and position.step < position.low_res_steps
        loss, logits = forward(run.model, low_res(images, r.low_res_size) if small else images, targets,
                               r.label_smoothing, run.memory_format, teacher,
                               (r.distill, r.distill_weight, r.distill_temperature))
    fabric.backward(loss)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if not isinstance(run.optimizer.optimizer, CompiledStep):  # the next step's rates (the compiled step writes them)
        set_rates(run.optimizer, run.base_lrs, run.schedule(position.step + 1))
    return loss, logits, targets, rate


def rank_own_draws(run: Run):
    """Under several processes, the training forward's own random draws (dropout, drop path) made apart on each
    rank: inside, the generators are seeded from one draw every rank makes alike plus the rank, and outside they
    stay equal on every rank (the augmentation draws for the global batch, and resume is exact). One process, or
    the CUDA-graphed step (whose replays keep their own generator offsets), draws as it is."""
    fabric = run.fabric
    if fabric.world_size == 1 or (run.plan.recipe.compile == "step" and fabric.device.type == "cuda"):
        return contextlib.nullcontext()
    base = int(torch.randint(2**31, ()))  # torch's CPU generator: a host value, no wait for the device
    return forked_generators(fabric.device, base * fabric.world_size + fabric.global_rank)


def forwarder(fabric):
    """Passes a signal on to the processes Fabric started (with several devices and no external launcher)."""
    procs = getattr(getattr(fabric.strategy, "launcher", None), "procs", None) or []

    def forward(signum: int) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)
    return forward


def decide(run: Run, flag: StopFlag, deciding: bool, check_nan: bool = True) -> tuple[int, bool]:
    """The decisions every rank takes alike, made on deciding steps (every step in one process, where they read only
    host values; under several, every few steps, which all ranks reach together): ``(the signal number or 0,
    whether a timed checkpoint is due)``. Any rank's signal stops every rank; rank 0's clock fits the budget again
    (after a step or validation time was measured; the schedule is refitted here) and times the checkpoints. With
    ``check_nan`` (every few steps: it reads a device value), any rank's non-finite loss stops the run
    (``check_finite``)."""
    if not deciding:
        return 0, False
    fabric, clock, r = run.fabric, run.clock, run.plan.recipe
    total = None
    if run.refit_due and run.plan.budget_s is not None and clock.step_times() is not None:
        total = clock.fit_steps(run.position.step, run.position.low_res_steps)
    run.refit_due = False
    timed = r.ckpt_every_minutes > 0 and clock.since_checkpoint() >= 60 * r.ckpt_every_minutes
    signum = flag.signum or 0
    if fabric.world_size > 1:
        signum = int(fabric.all_reduce(torch.tensor(float(signum)), reduce_op="max"))
        total, timed = fabric.broadcast((total, timed))
    if check_nan:
        check_finite(run)
    if total is not None:
        refit(run, total)
    return signum, timed


def check_finite(run: Run) -> None:
    """NonFiniteLossError naming the first step of any rank whose loss was not finite (one host read; under
    several processes a collective every rank makes at the same step)."""
    bad = run.first_bad_step
    if run.fabric.world_size > 1:
        never = torch.iinfo(torch.long).max
        bad = run.fabric.all_reduce(torch.where(bad < 0, never, bad), reduce_op="min")
        bad = torch.where(bad == never, -1, bad)
    step = int(bad)
    if step >= 0:
        raise NonFiniteLossError(
            f"non-finite training loss at optimizer step {step}; stopped (the last checkpoint written is from "
            "before it). Lower --lr, add warm-up or use --precision 32")


def refit(run: Run, total: int) -> None:
    """Stretch / shrink the warm-up and decay to end at ``total`` steps (the budget's); progressive resizing's
    switch moves with it until it is reached."""
    r, position = run.plan.recipe, run.position
    run.clock.total_steps = total
    run.schedule.total_steps = max(int(total), position.step + 1)
    run.schedule.warmup_steps = round(run.schedule.total_steps * min(r.warmup_epochs / max(r.epochs, 1), 1.0))
    if r.low_res_size and position.step < position.low_res_steps:
        position.low_res_steps = max(round(run.schedule.total_steps * r.low_res_until), position.step)
    sync_rates(run)


def sync_rates(run: Run) -> None:
    """The next step's learning rates set from the host (at the start and after a refit); for the compiled step, its
    device-side schedule."""
    optimizer = run.optimizer.optimizer
    if isinstance(optimizer, CompiledStep):
        optimizer.sync_schedule(run.schedule, run.base_lrs, run.position.step)
    else:
        set_rates(run.optimizer, run.base_lrs, run.schedule(run.position.step))


def end_epoch(run: Run) -> None:
    """An epoch's end (or the budget's, inside an epoch): the validation (the EMA's weights), the epoch's row,
    best.ckpt when the validation top-1 is the best so far."""
    fabric, position = run.fabric, run.position
    trained = run.totals.compute(fabric_sum(fabric))
    scores = evaluate(run, run.data.val_dataloader(), run.val_batches, "on_validation_batch_start", "Validation")
    run.clock.epoch_ended()
    log(run, {"epoch": position.epoch, "step": position.step, "train/loss_epoch": trained["loss"],
              "train/top1": trained["top1"], "train/top5": trained["top5"], "val/loss": scores["loss"],
              "val/top1": scores["top1"], "val/top5": scores["top5"], "time/elapsed_s": run.clock.elapsed()})
    position.epoch += 1
    position.batch = 0
    run.totals = Totals(run.data.num_classes, fabric.device)
    run.refit_due = run.plan.budget_s is not None  # the validation was timed: the budget is fitted again
    if scores["images"] and (position.best_val_top1 is None or scores["top1"] > position.best_val_top1):
        position.best_val_top1 = scores["top1"]
        save(run, run.plan.run_dir / "checkpoints" / "best.ckpt", epoch_done=True)


def fabric_sum(fabric):
    return (lambda tensor: fabric.all_reduce(tensor, reduce_op="sum")) if fabric.world_size > 1 else None


@torch.no_grad()
def evaluate(run: Run, loader, batches: int, hook: str, description: str) -> dict:
    """Loss, top-1 and top-5 of the model (the EMA's weights where EMA is on) on ``batches`` of ``loader``, under
    the recipe's test-time augmentation, summed over every process's shard (each image counts once)."""
    fabric, r = run.fabric, run.plan.recipe
    totals = Totals(run.data.num_classes, fabric.device)
    bar = run.progress.batches(description, batches, 1 if description == "Validation" else 0)
    with run.clock.validation(fabric.device), (run.ema.swapped_in() if run.ema else contextlib.nullcontext()):
        run.net.eval()
        for images, labels in itertools.islice(loader, batches):
            fabric.call(hook, run=run)
            images, labels = fabric.to_device((images, labels))
            with fabric.autocast():
                loss, logits = eval_loss(run.net, run.data.normalize(images), labels, r.label_smoothing, r.tta,
                                         run.memory_format)
            totals.add(loss, logits, labels)
            if bar is not None:
                bar.update(1)
        run.net.train()
    if bar is not None:
        bar.close()
    return totals.compute(fabric_sum(fabric))


def log(run: Run, row: dict) -> None:
    """A row into metrics.csv (rank 0) and Fabric's loggers."""
    if run.metrics is not None:
        run.metrics.log(row)
    run.fabric.log_dict({k: v for k, v in row.items() if k != "step"}, step=row["step"])


def show(run: Run, loss: torch.Tensor) -> None:
    """The progress line after a step (its values read from the device only when it is drawn)."""
    position, clock = run.position, run.clock
    total = clock.run_steps(position.step, position.low_res_steps)
    if not run.progress.due(position.step):
        return
    values = {"train/loss": f"{loss.item():.3g}"}
    left = clock.remaining_s(position.step, position.low_res_steps)
    if left is not None:
        values["run left"] = format_duration(left + test_seconds(run))
    run.progress.update(position.epoch, position.step, total, values)


def test_seconds(run: Run) -> float:
    """The test after the fit: an image's forward pass costs about a third of its share of a training step, times
    the passes test-time augmentation makes."""
    times = run.clock.step_times()
    if times is None:
        return 0.0
    return times[1] / run.plan.recipe.batch_size / 3 * run.clock.eval_passes * tested_images(run)


def tested_images(run: Run) -> int:
    """The images the test after the fit reads (the test split, or the batches ``limit_test_batches`` keeps)."""
    return min(run.data.num_test_images, run.test_batches * run.data.eval_batch_size)


def announce_model(run: Run) -> None:
    info = model_info(run.net)
    _, height, width = info["input_size"]
    run.progress.say(f"{run.plan.recipe.model}: {info['params'] / 1e6:.2f} M parameters, "
                     f"{info['flops'] / 1e6:,.0f} M FLOPs per {height}x{width} image")
    if run.plan.recipe.compile == "step":
        run.progress.say("compiling the training step (the first run on this machine takes longer)")
    elif run.plan.recipe.compile:
        run.progress.say(f"compile: {run.plan.recipe.compile}: the first training steps and the first validation "
                         "compile the model (torch.compile), which takes longer than a step")


def announce_plan(run: Run) -> None:
    """The plan line before the first step, from the step time the probes measured (without one, nothing yet:
    the line follows once steps are measured)."""
    times = run.clock.step_times()
    if times is None:
        return
    run.announced = True
    position, r, clock = run.position, run.plan.recipe, run.clock
    for line in plan_lines(r, accelerator=run.plan.accelerator, machine=run.plan.machine,
                           precision=FABRIC_PRECISION[run.plan.precision],
                           steps=clock.run_steps(position.step, position.low_res_steps), done=position.step,
                           steps_per_epoch=run.steps_per_epoch, budget_s=run.plan.budget_s,
                           train_s=clock.remaining_s(position.step, position.low_res_steps) or 0.0,
                           test_s=test_seconds(run), test_images=tested_images(run), eval_passes=clock.eval_passes,
                           step_seconds=step_seconds_text(times, r.low_res_size, r.img_size),
                           timed_before=clock.step_time is None):
        run.progress.say(line)


# ---------------------------------------------------------------------------------------------------- checkpoints


def checkpoint_state(run: Run, epoch_done: bool) -> dict:
    """Everything a resumed run needs (see the module), in the layout Lightning's ``load_from_checkpoint`` and
    ``zoo.load_run`` read: ``state_dict`` (``model.``-prefixed weights: the EMA's where EMA is on) and
    ``hyper_parameters`` (``ImageClassifier``'s arguments)."""
    r, position = run.plan.recipe, run.position
    trained = {f"model.{k}": v.detach().clone() for k, v in run.net.state_dict().items()}
    weights = {f"model.{k}": v.detach().clone() for k, v in run.ema.averaged.items()} if run.ema else trained
    return {
        "pytorch-lightning_version": lightning.__version__,
        "hyper_parameters": {"model_name": r.model, "model_args": model_args(r), "num_classes": run.data.num_classes,
                             "label_smoothing": r.label_smoothing, "tta": r.tta, "lr": r.lr,
                             "weight_decay": r.weight_decay, "optimizer": r.optimizer, "momentum": r.momentum,
                             "no_decay_lr_scale": r.no_decay_lr_scale, "muon_dtype": r.muon_dtype,
                             "channels_last": uses_channels_last(r)},
        "state_dict": weights,
        "trained_state_dict": trained if run.ema else None,
        "ema_count": run.ema.count.clone() if run.ema else None,
        "optimizer": run.optimizer.state_dict(),
        "schedule": (run.schedule.warmup_steps, run.schedule.total_steps),
        "global_step": position.step,
        "epoch": position.epoch,
        "loop": asdict(position),
        "clock": run.clock.state_dict(),
        "random": random_states(),
        "data_order": run.data.order_state(position.batch, epoch_done or position.batch == 0),
        "epoch_totals": run.totals.state_dict() if position.batch and not epoch_done else None,
    }


def save(run: Run, path: Path, epoch_done: bool = False) -> None:
    """Write a checkpoint atomically (rank 0, every rank at the same step; its seconds leave throughput out) after
    the NaN check (a model that saw a non-finite loss is never saved); metrics.csv's rows reach the disk first."""
    check_finite(run)
    state = checkpoint_state(run, epoch_done)
    with run.clock.paused():
        if run.fabric.is_global_zero:
            if run.metrics is not None:
                run.metrics.sync()
            save_checkpoint(path, state)
        run.fabric.barrier()


def save_last(run: Run, last: Path) -> None:
    save(run, last)
    run.last_saved_step = run.position.step
    run.clock.checkpoint_written()


# ---------------------------------------------------------------------------------------------------- the test


def test(run: Run) -> dict:
    """The best checkpoint's weights (the last ones when there is none) on the test split: summary.json's test keys
    and metrics.csv's test row at the run's last step. ``test_loss_smoothed`` is the training objective
    (label-smoothed, with the recipe's test-time augmentation), not the plain cross-entropy eval.py reports."""
    best = run.plan.run_dir / "checkpoints" / "best.ckpt"
    tested = best if best.is_file() else None
    if run.fabric.is_global_zero:
        print(f"testing {tested.name if tested else 'the last weights'} on the test split", flush=True)
    if tested is not None:
        weights = strip_prefix(load_training_checkpoint(tested)["state_dict"])
        run.net.load_state_dict(weights)
        run.ema = None  # the checkpoint's weights are the EMA's already
    scores = evaluate(run, run.data.test_dataloader(), run.test_batches, "on_test_batch_start", "Testing")
    log(run, {"epoch": run.position.epoch, "step": run.position.step, "test/loss": scores["loss"],
              "test/top1": scores["top1"], "test/top5": scores["top5"]})
    if run.metrics is not None:
        run.metrics.close()
    return {"test_top1": scores["top1"], "test_top5": scores["top5"], "test_loss_smoothed": scores["loss"],
            "tested_checkpoint": tested.name if tested else "last"}


def summarize(run: Run, tested: dict) -> dict:
    """summary.json: the model, hardware, training progress and speed, accuracies and the data's facts."""
    plan, data, clock = run.plan, run.data, run.clock
    info = model_info(run.net)
    later = clock.later_images_per_s()
    return {
        "model": plan.recipe.model, "params": info["params"], "flops": info["flops"], "precision": plan.precision,
        "accelerator": plan.accelerator, "devices": run.fabric.world_size,
        "epochs": run.position.epoch, "global_step": run.position.step, "wall_time_s": round(clock.elapsed(), 2),
        "train_images_per_s": round(clock.images_per_s(), 1),
        "train_images_per_s_after_first_epoch": round(later, 1) if later is not None else None,
        "best_val_top1": run.position.best_val_top1, **tested,
        "label_smoothing": plan.recipe.label_smoothing,
        "num_classes": data.num_classes, "class_names": list(data.class_names), "img_size": data.img_size,
        "mean": list(data.mean), "std": list(data.std), "machine": plan.machine,
        "float32_matmul_precision": torch.get_float32_matmul_precision(), "optimizer": plan.recipe.optimizer,
        "muon_dtype": plan.recipe.muon_dtype,
        **({"peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30} if plan.accelerator == "gpu" else {}),
    }

