"""``fit``: one resumable training run from a resolved ``Recipe``, in named steps: the plan (``plan_run``: every
decision made once, before anything is written: device, precision, run directory, resume, budget; a resumed run is
checked against the recipe and the data), the run directory (a new one is removed again when it fails before its
first checkpoint), the data module, the LightningModule and the Trainer (each given its section of the recipe by
name), the callbacks, the test of the best checkpoint and summary.json (keys in the DESIGN's run contract;
accuracies are fractions in [0, 1])."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (
    LearningRateMonitor,
    ModelCheckpoint,
    WeightAveraging,
)

from ..atomic import atomic_write_json
from ..models import create_model, model_info
from .callbacks import (
    EMAWeightAveraging,
    LastCheckpoint,
    LossProgressBar,
    StepTimer,
    Throughput,
    TimeBudget,
    TimedCheckpoint,
    ValidationClock,
)
from .checks import parse_max_time
from .compiled import compile_cache_dir, inductor_cache_counts, use_compile_cache
from .data import ImageDataModule
from .data.cache import user_cache_dir
from .device import (
    compile_for,
    host_sync_every,
    machine_name,
    resolve_accelerator,
    resolve_muon_dtype,
    resolve_precision,
)
from .distill import load_teacher
from .distributed import (
    external_environment,
    is_global_zero,
    on_rank_zero,
    open_process_group,
    planned_world_size,
    rank_zero_first,
    split_batch,
)
from .forecast import RunForecast
from .host_memory import keep_freed_memory
from .loggers import build_loggers, require_loggers
from .module import ImageClassifier
from .preemption import EpochMetrics, Interrupted, PreemptionCheckpoint, RandomStates, stops_at_once
from .probes import model_args, probe_optimizer, probe_precision, probe_step_seconds, uses_channels_last
from .quiet import quiet_libraries
from .recipe import Recipe
from .runs import (
    AtomicCheckpointIO,
    RunLock,
    check_resume_data,
    check_resume_weights,
    checkpoint_step,
    create_run_dir,
    find_run_dir,
    recorded_choice,
    remove_failed_run,
)
from .warmstart import init_from, match_init

WHITENING_IMAGES = 5000  # training images whose patches set the whitening filters (airbench uses 5,000)


@dataclass(frozen=True)
class RunPlan:
    """Every decision of a run, made once before anything is written (``plan_run``) and what the rest is built from:
    the recipe as resolved on this machine (its precision, optimizer, muon_dtype and compile the ones chosen here),
    the device, the run directory and the checkpoint it resumes, and the time budget. ``describe()`` says it in one
    line."""

    recipe: Recipe
    accelerator: str            # "cpu", "gpu" or "mps" ("auto" resolved)
    precision: str              # "32", "bf16-mixed" or "16-mixed" ("auto" resolved)
    run_dir: Path
    resume_from: Path | None    # checkpoints/last.ckpt of a resumed run, else None
    setup_s: float = 0.0        # seconds the run spent before its model was built (the precision probe)
    world_size: int = 1         # processes (devices x nodes)
    budget_s: float | None = None  # --max-time in seconds (the fit gets it less the seconds spent before it)
    machine: str = ""           # the CPU or GPU the numbers come from (``device.machine_name``)
    step_s: float | None = None  # a training step's seconds as the probes timed it before training (CPU), else None
    teacher: torch.nn.Module | None = None  # the frozen teacher of ``teacher`` (``distill.load_teacher``), else None

    def describe(self) -> str:
        """E.g. "vit_tiny on cpu (Intel ... (2 cores, native bf16: no)), 1 process, precision 32, optimizer adamw,
        100 epochs, no time budget, new run runs/vit_tiny/20260101-120000-3fa2"."""
        r = self.recipe
        budget = f"--max-time {r.max_time}" if r.max_time else "no time budget"
        run = f"resuming {self.resume_from}" if self.resume_from else f"new run {self.run_dir}"
        return (f"{r.model} on {self.accelerator} ({self.machine}), {self.world_size} process"
                f"{'es' if self.world_size > 1 else ''}, precision {self.precision}, optimizer {r.optimizer}, "
                f"{r.epochs} epochs, {budget}, {run}")


class RunCallbacks(NamedTuple):
    best: ModelCheckpoint       # best.ckpt by val/top1 (last.ckpt comes from the other checkpoint callbacks)
    throughput: Throughput
    all: list[pl.Callback]
    checkpoint_io: AtomicCheckpointIO  # the trainer's checkpoint writer, whose write time throughput leaves out


def fit(recipe: Recipe) -> Path:
    """Train one run from a resolved recipe (``zoo.train.recipe.resolve_config``) and return its run directory,
    which holds config.yaml, metrics.csv, checkpoints/{last,best}.ckpt and summary.json. With ``recipe.resume``
    ("auto" or a run directory / checkpoint) the run continues where its last.ckpt ends, once its model, model
    arguments, image size and classes are checked against the recipe and the data (nothing is written before)."""
    quiet_libraries()
    keep_freed_memory()  # before the precision probe, which times steps as training will run them
    # SIGTERM, SIGUSR1 or Ctrl-C while the data are decoded or the probes run: nothing written yet; one line and
    # 128 + the signal, as in every later phase (SIGTERM's default action would end the process without a word)
    try:
        with stops_at_once("before training"):
            plan, dm = plan_run(recipe)
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
        return train_and_test(plan, dm)
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


def plan_run(recipe: Recipe) -> tuple[RunPlan, ImageDataModule]:
    """The run's plan and its data module (built by one process first: the data cache), every choice checked before
    anything is written: the device and process count, the run directory (a resumed one checked against the data),
    an ``init_from`` that must load, and the precision, Muon dtype and optimizer (a resumed run keeps the ones its
    config.yaml records; ``auto`` measured on a CPU with native bf16)."""
    accelerator = resolve_accelerator(recipe.accelerator, recipe.devices)
    require_loggers(recipe.loggers)
    world_size = planned_world_size(recipe.devices, recipe.num_nodes, accelerator)
    split_batch(recipe.batch_size, world_size)
    report_auto_devices(recipe, accelerator, world_size)
    open_process_group(accelerator)  # under torchrun / SLURM: rank 0 chooses the run directory for all ranks
    run_dir, resume_from, _ = on_rank_zero(lambda: find_run_dir(recipe))
    dm = rank_zero_first(lambda: build_datamodule(recipe))  # one process builds the data cache
    if resume_from is not None:
        check_resume_data(resume_from, dm.num_classes, dm.class_names)
        check_resume_weights(resume_from, create_model(recipe.model, num_classes=dm.num_classes, **model_args(recipe)))
    elif recipe.init_from:  # a refused --init-from fails before the precision probe's seconds
        match_init(create_model(recipe.model, num_classes=dm.num_classes, **model_args(recipe)), recipe.init_from,
                   allow_partial=recipe.init_partial)
    # a teacher that cannot teach this run (other classes or image size) fails before the probe's seconds
    teacher = load_teacher(recipe.teacher, dm.num_classes, recipe.img_size) if recipe.teacher else None
    start = time.perf_counter()
    one_process = world_size == 1  # DDP ranks must not measure (and choose) apart
    chosen = {key: getattr(recipe, key) for key in ("precision", "muon_dtype", "optimizer")}
    if resume_from is not None:  # a resumed run keeps the choices it started with (config.yaml records them)
        chosen = {key: recorded_choice(run_dir, key, value, accelerator) for key, value in chosen.items()}
    probed = replace(recipe, batch_size=min(recipe.batch_size, len(dm.train_dataset)))  # the largest step taken
    precision = resolve_precision(chosen["precision"], accelerator,
                                  (lambda options: probe_precision(probed, options)) if one_process else None)
    muon_dtype = resolve_muon_dtype(chosen["muon_dtype"], accelerator)
    optimizer, timed = chosen["optimizer"], {}
    if resume_from is None and one_process and accelerator == "cpu":
        optimizer = probe_optimizer(probed, precision, muon_dtype, timed)
    step_s = None
    if one_process and accelerator == "cpu":  # the run's estimate, printed before its first step (RunForecast)
        step_s = timed.get(optimizer) or probe_step_seconds(replace(probed, optimizer=optimizer), precision,
                                                            muon_dtype)
    resolved = replace(recipe, precision=precision, muon_dtype=muon_dtype, optimizer=optimizer,
                       compile=compile_for(recipe.compile, accelerator))
    budget_s = parse_max_time(recipe.max_time) if recipe.max_time else None
    return RunPlan(resolved, accelerator, precision, run_dir, resume_from, time.perf_counter() - start, world_size,
                   budget_s, machine_name(accelerator), step_s, teacher), dm


def report_auto_devices(recipe: Recipe, accelerator: str, world_size: int) -> None:
    """One line when ``devices: auto`` takes several GPUs of this machine (printed by rank 0 only)."""
    if recipe.devices == "auto" and accelerator == "gpu" and world_size > 1 and external_environment() is None \
            and is_global_zero():
        print(f"--devices auto: all {world_size} GPUs of this machine, one DDP process each; batch_size "
              f"{recipe.batch_size} is the global batch ({recipe.batch_size // world_size} per GPU)")


def train_and_test(plan: RunPlan, dm: ImageDataModule) -> Path:
    """Fit, test the best checkpoint and write summary.json; a new run that ends before its first optimizer
    step (a time budget too small for one) -> ValueError; a finished run resumed with nothing left to train keeps
    its test and summary.json."""
    pl.seed_everything(plan.recipe.seed, workers=True, verbose=False)
    if plan.accelerator == "gpu":  # fp32 matmuls on tensor cores (TF32), as --precision 32 users of a GPU expect
        torch.set_float32_matmul_precision("high")
    start = time.perf_counter()
    compiling = start_compile_cache(plan)
    module = build_module(plan, dm)
    callbacks = build_callbacks(plan, spent_s=plan.setup_s + time.perf_counter() - start,
                                test_images=tested_images(plan.recipe, dm))
    trainer = build_trainer(plan, callbacks)
    resumed_at = checkpoint_step(plan.resume_from) if plan.resume_from else None
    last = plan.run_dir / "checkpoints" / "last.ckpt"
    start = time.perf_counter()
    with stops_at_once("before training", last):  # in training, PreemptionCheckpoint's handlers take over
        trainer.fit(module, datamodule=dm, ckpt_path=str(plan.resume_from) if plan.resume_from else None)
    fit_s = time.perf_counter() - start
    if trainer.global_step == resumed_at and (plan.run_dir / "summary.json").is_file():  # a finished run: kept
        print(f"the run had finished ({resumed_at} steps, {trainer.current_epoch} epochs): nothing to train, its "
              f"test and summary.json kept; give more --epochs to train it on")
        return plan.run_dir
    if trainer.global_step == 0:
        raise ValueError(f"training ended before its first optimizer step (--max-time {plan.recipe.max_time}, "
                         f"--limit-train-batches {plan.recipe.limit_train_batches}): nothing to save")
    with stops_at_once("during the final test", last):  # Lightning would exit 0 (SIGTERM) or 1 (Ctrl-C)
        tested = run_test(trainer, module, dm, callbacks.best)
    if trainer.is_global_zero:
        summary = summarize(plan, trainer, callbacks, fit_s, tested)
        atomic_write_json(plan.run_dir / "summary.json", {**summary, **compile_facts(trainer, compiling)})
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


def compile_facts(trainer: pl.Trainer, compiling: dict | None) -> dict:
    """summary.json's compile keys: ``compile_s``, the seconds of the first training step under ``compile: step``
    (which compiles; training seconds and images/s include it, ``train_images_per_s_after_first_epoch`` does not),
    and the Inductor cache's hits and misses in this process (a second run on the machine hits)."""
    if compiling is None:
        return {}
    counts = inductor_cache_counts()
    return {"compile_s": getattr(trainer.optimizers[0], "compile_s", None) if trainer.optimizers else None,
            "compile_cache": str(compiling["folder"]),
            **{key: counts[key] - compiling[key] for key in counts}}


def build_datamodule(recipe: Recipe) -> ImageDataModule:
    """The data module, its data found (or downloaded), decoded into the cache and split."""
    dm = ImageDataModule(**recipe.kwargs_for(ImageDataModule, memory_budget=recipe.data_memory_budget))
    if is_global_zero():  # the first line of a run: reading (or decoding) the data comes first
        print(f"{recipe.model}: reading the images of {dm.data_dir}", flush=True)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def build_module(plan: RunPlan, dm: ImageDataModule) -> ImageClassifier:
    """The LightningModule around ``zoo.create_model``; a new run computes its patch-whitening filters (if the
    model has any) from the training images, and one with ``init_from`` starts from those weights."""
    recipe = plan.recipe
    module = ImageClassifier(**recipe.kwargs_for(  # lr, optimizer, schedule, ... by their recipe keys
        ImageClassifier, model_name=recipe.model, model_args=model_args(recipe), num_classes=dm.num_classes,
        warmup_frac=min(recipe.warmup_epochs / max(recipe.epochs, 1), 1.0), channels_last=uses_channels_last(recipe)))
    # a resumed run's checkpoint holds its filters; fit_whitening=false keeps the random ones (the ablation)
    if plan.resume_from is None and module.whitening_layers and recipe.fit_whitening:
        print(f"fitting the patch-whitening filters to {min(WHITENING_IMAGES, len(dm.train_dataset)):,} training "
              "images")
        module.fit_whitening(dm.normalize(dm.train_dataset[:WHITENING_IMAGES][0]))  # read alone when streamed
    if recipe.init_from and plan.resume_from is None:
        print(init_from(module.model, recipe.init_from, allow_partial=recipe.init_partial).summary())
    module.set_teacher(plan.teacher)
    return module


def tested_images(recipe: Recipe, dm: ImageDataModule) -> int:
    """The images the test after the fit reads (the test split, or the batches ``limit_test_batches`` keeps)."""
    images, size = dm.num_test_images, dm.eval_batch_size
    batches, limit = math.ceil(images / size), recipe.limit_test_batches
    kept = batches if limit is None else int(batches * limit) if isinstance(limit, float) else min(batches, limit)
    return min(images, kept * size)


def build_callbacks(plan: RunPlan, spent_s: float = 0.0, test_images: int = 0) -> RunCallbacks:
    """Checkpoints (best by val/top1; last every N steps, every few minutes and at the end), throughput
    (checkpoint writes excluded), progress, LR log, the EMA of the weights (``EMAWeightAveraging``:
    validation, checkpoints and the test see the average), the time budget (less ``spent_s``, what the run spent
    before the fit: the precision probe, building the model and its whitening filters)."""
    recipe, ckpt_dir, writes = plan.recipe, plan.run_dir / "checkpoints", AtomicCheckpointIO()
    best = ModelCheckpoint(ckpt_dir, "best", monitor="val/top1", mode="max", save_top_k=1,
                           enable_version_counter=False)
    # last.ckpt every N steps and when training ends (an exception or a signal saves it elsewhere)
    steps = LastCheckpoint(ckpt_dir, "last", save_top_k=0, save_last=True,
                            every_n_train_steps=recipe.ckpt_every_n_steps, enable_version_counter=False)
    # and every few minutes of training, not after every validation: on a GPU an epoch takes seconds, and writing
    # the weights and optimizer state that often would cost more than training
    callbacks = [best, steps]
    # the decisions all ranks share (time checks, a signal) wait for every few steps on a GPU: each is a host sync
    every = host_sync_every(plan.accelerator)
    if recipe.ckpt_every_minutes > 0:
        interval = timedelta(minutes=recipe.ckpt_every_minutes)
        callbacks.append(TimedCheckpoint(ckpt_dir, "last", train_time_interval=interval, enable_version_counter=False,
                                         decide_every=every))
    throughput = Throughput(writes)
    budget_s = plan.budget_s - spent_s if plan.budget_s is not None else None
    # the forecast first: its plan line comes before the progress bar is drawn
    callbacks += [throughput, RunForecast(recipe, plan.accelerator, plan.machine, budget_s, probe_step_s=plan.step_s,
                                          test_images=test_images),
                  LossProgressBar(refresh_rate=1 if plan.accelerator == "cpu" else 20), LearningRateMonitor("step"),
                  ValidationClock()]
    if recipe.ema_decay:
        callbacks.append(EMAWeightAveraging(recipe.ema_decay))
    # a signal saves last.ckpt at the step it arrives; checkpoints hold the random states and the epoch's metrics so
    # far (exact resume)
    callbacks += [RandomStates(), EpochMetrics(), PreemptionCheckpoint(ckpt_dir / "last.ckpt", decide_every=every)]
    if budget_s is not None:  # the schedule fitted to the budget; the timer stops the fit (as Trainer(max_time))
        callbacks += [TimeBudget(budget_s), StepTimer(recipe.max_time, decide_every=every)]
    return RunCallbacks(best, throughput, callbacks, writes)


def build_trainer(plan: RunPlan, callbacks: RunCallbacks) -> pl.Trainer:
    """The Lightning Trainer: metrics.csv kept across resumes (and the recipe's other loggers), atomic checkpoint
    writes, no sanity check."""
    recipe = plan.recipe  # devices, strategy, num_nodes, limit_*_batches by their recipe keys (max_time: StepTimer)
    return pl.Trainer(**recipe.kwargs_for(
        pl.Trainer, accelerator=plan.accelerator, precision=plan.precision, max_epochs=recipe.epochs,
        logger=build_loggers(recipe.loggers, plan.run_dir, plan.resume_from), callbacks=callbacks.all,
        max_time=None, plugins=[callbacks.checkpoint_io], log_every_n_steps=min(50, recipe.ckpt_every_n_steps),
        num_sanity_val_steps=0,
        enable_model_summary=False))  # RunForecast says the size (Lightning's table counts FLOPs as 0)


def run_test(trainer: pl.Trainer, module: ImageClassifier, dm: ImageDataModule, best: ModelCheckpoint) -> dict:
    """Test the best checkpoint (the last weights when there is none): summary.json's test keys.
    ``test_loss_smoothed`` is the training objective (label-smoothed cross-entropy, with the recipe's test-time
    augmentation), not the plain cross-entropy eval.py reports as ``test_cross_entropy``."""
    tested = best.best_model_path if best.best_model_path and Path(best.best_model_path).exists() else None
    # A checkpoint's state_dict holds the EMA weights (the ones validation scored and load_run / eval.py read),
    # but WeightAveraging.on_load_checkpoint would swap the raw weights back in for the test: it steps aside.
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, WeightAveraging)]
    # metrics.csv's test row at the run's last step, as in an uninterrupted run (Lightning restores one less into a
    # resumed run that had nothing left to train)
    trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step
    if trainer.is_global_zero:
        print(f"testing {Path(tested).name if tested else 'the last weights'} on the test split", flush=True)
    results = trainer.test(module, datamodule=dm, ckpt_path=tested)[0]
    return {"test_top1": float(results["test/top1"]), "test_top5": float(results["test/top5"]),
            "test_loss_smoothed": float(results["test/loss"]), "tested_checkpoint": Path(tested or "last").name}


def summarize(plan: RunPlan, trainer: pl.Trainer, callbacks: RunCallbacks, fit_s: float, tested: dict) -> dict:
    """summary.json: the model, hardware, training progress and speed, accuracies and the data's facts."""
    info, dm = model_info(trainer.lightning_module.model), trainer.datamodule
    best_score = callbacks.best.best_model_score
    later = callbacks.throughput.later_images_per_s  # None after a single epoch
    return {
        "model": plan.recipe.model, "params": info["params"], "flops": info["flops"], "precision": plan.precision,
        "accelerator": plan.accelerator, "devices": trainer.num_devices * trainer.num_nodes,
        "epochs": trainer.current_epoch, "global_step": trainer.global_step, "wall_time_s": round(fit_s, 2),
        "train_images_per_s": round(callbacks.throughput.images_per_s, 1),
        "train_images_per_s_after_first_epoch": round(later, 1) if later is not None else None,
        "best_val_top1": float(best_score) if best_score is not None else None, **tested,
        "label_smoothing": plan.recipe.label_smoothing,
        "num_classes": dm.num_classes, "class_names": list(dm.class_names), "img_size": dm.img_size,
        "mean": list(dm.mean), "std": list(dm.std), "machine": plan.machine,
        "float32_matmul_precision": torch.get_float32_matmul_precision(), "optimizer": plan.recipe.optimizer,
        "muon_dtype": plan.recipe.muon_dtype,
        **({"peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30} if plan.accelerator == "gpu" else {}),
    }
