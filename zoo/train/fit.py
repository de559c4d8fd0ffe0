"""``fit``: one resumable training run from a resolved ``Recipe``, in named steps: the run directory (``runs``: a
resumed run is checked against the recipe and the data before anything is written; a new one is removed again
when it fails before its first checkpoint), the data module, the LightningModule, the callbacks, the Lightning
Trainer, the test of the best checkpoint and summary.json (keys in the DESIGN's run contract; accuracies are
fractions in [0, 1])."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (
    LearningRateMonitor,
    ModelCheckpoint,
    Timer,
    WeightAveraging,
)

from ..atomic import atomic_write_json
from ..models import create_model, model_info
from .callbacks import EMAWeightAveraging, LossProgressBar, Throughput, TimeBudget, ValidationClock
from .data import ImageDataModule
from .device import compile_for, machine_name, resolve_accelerator, resolve_muon_dtype, resolve_precision
from .distributed import (
    external_environment,
    is_global_zero,
    on_rank_zero,
    open_process_group,
    planned_world_size,
    rank_zero_first,
    split_batch,
)
from .loggers import build_loggers, require_loggers
from .module import ImageClassifier
from .preemption import PreemptionCheckpoint, RandomStates
from .probes import model_args, probe_optimizer, probe_precision, uses_channels_last
from .recipe import Recipe, parse_max_time
from .runs import (
    AtomicCheckpointIO,
    RunLock,
    check_resume_data,
    create_run_dir,
    find_run_dir,
    recorded_choice,
    remove_failed_run,
)
from .warmstart import init_from, match_init

WHITENING_IMAGES = 5000  # training images whose patches set the whitening filters (airbench uses 5,000)


@dataclass(frozen=True)
class RunPlan:
    """A recipe with what it resolved to on this machine (its precision, optimizer and muon_dtype the ones chosen
    here): the run directory and the checkpoint to resume."""

    recipe: Recipe
    accelerator: str            # "cpu" or "gpu" ("auto" resolved)
    precision: str              # "32", "bf16-mixed" or "16-mixed" ("auto" resolved)
    run_dir: Path
    resume_from: Path | None    # checkpoints/last.ckpt of a resumed run, else None
    setup_s: float = 0.0        # seconds the run spent before its model was built (the precision probe)


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
    accelerator = resolve_accelerator(recipe.accelerator, recipe.devices)
    require_loggers(recipe.loggers)
    world_size = planned_world_size(recipe.devices, recipe.num_nodes, accelerator)
    split_batch(recipe.batch_size, world_size)  # before anything is written
    report_auto_devices(recipe, accelerator, world_size)
    open_process_group(accelerator)  # under torchrun / SLURM: rank 0 chooses the run directory for all ranks
    run_dir, resume_from, new = on_rank_zero(lambda: find_run_dir(recipe))
    dm = rank_zero_first(lambda: build_datamodule(recipe))  # one process builds the data cache
    if resume_from is not None:
        check_resume_data(resume_from, dm.num_classes, dm.class_names)
    elif recipe.init_from:  # a refused --init-from fails before the precision probe's seconds
        match_init(create_model(recipe.model, num_classes=dm.num_classes, **model_args(recipe)), recipe.init_from,
                   allow_partial=recipe.init_partial)
    start = time.perf_counter()
    one_process = world_size == 1  # DDP ranks must not measure (and choose) apart
    precision, muon_dtype, optimizer = recipe.precision, recipe.muon_dtype, recipe.optimizer
    if resume_from is not None:  # a resumed run keeps the choices it started with (config.yaml records them)
        precision = recorded_choice(run_dir, "precision", precision, accelerator)
        muon_dtype = recorded_choice(run_dir, "muon_dtype", muon_dtype, accelerator)
        optimizer = recorded_choice(run_dir, "optimizer", optimizer, accelerator)
    precision = resolve_precision(precision, accelerator,
                                  (lambda options: probe_precision(recipe, options)) if one_process else None)
    muon_dtype = resolve_muon_dtype(muon_dtype, accelerator)
    if resume_from is None and one_process and accelerator == "cpu":
        optimizer = probe_optimizer(recipe, precision, muon_dtype)
    resolved = replace(recipe, precision=precision, muon_dtype=muon_dtype, optimizer=optimizer,
                       compile=compile_for(recipe.compile, accelerator))
    # the run directory is held by one process: a second one resuming it stops here in one line, before it
    # rewrites anything (a run refused earlier, for other data or another model, touched nothing)
    lock, created = RunLock(run_dir) if is_global_zero() else None, None
    if lock is not None and resume_from is not None:
        lock.acquire()
    try:
        created = on_rank_zero(lambda: create_run_dir(resolved, run_dir))
        if lock is not None and resume_from is None:
            lock.acquire()
        plan = RunPlan(resolved, accelerator, precision, run_dir, resume_from, time.perf_counter() - start)
        return train_and_test(plan, dm)
    except BaseException:
        if new and is_global_zero():
            lock.release()
            remove_failed_run(run_dir, created)
        raise
    finally:
        if lock is not None:
            lock.release()


def report_auto_devices(recipe: Recipe, accelerator: str, world_size: int) -> None:
    """One line when ``devices: auto`` takes several GPUs of this machine (printed by rank 0 only)."""
    if recipe.devices == "auto" and accelerator == "gpu" and world_size > 1 and external_environment() is None \
            and is_global_zero():
        print(f"--devices auto: all {world_size} GPUs of this machine, one DDP process each; batch_size "
              f"{recipe.batch_size} is the global batch ({recipe.batch_size // world_size} per GPU)")


def train_and_test(plan: RunPlan, dm: ImageDataModule) -> Path:
    """Fit, test the best checkpoint and write summary.json; a new run that ends before its first optimizer
    step (a time budget too small for one) -> ValueError."""
    pl.seed_everything(plan.recipe.seed, workers=True, verbose=False)
    if plan.accelerator == "gpu":  # fp32 matmuls on tensor cores (TF32), as --precision 32 users of a GPU expect
        torch.set_float32_matmul_precision("high")
    start = time.perf_counter()
    module = build_module(plan, dm)
    callbacks = build_callbacks(plan, spent_s=plan.setup_s + time.perf_counter() - start)
    trainer = build_trainer(plan, callbacks)
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm, ckpt_path=str(plan.resume_from) if plan.resume_from else None)
    fit_s = time.perf_counter() - start
    if trainer.global_step == 0:
        raise ValueError(f"training ended before its first optimizer step (--max-time {plan.recipe.max_time}, "
                         f"--limit-train-batches {plan.recipe.limit_train_batches}): nothing to save")
    tested = run_test(trainer, module, dm, callbacks.best)
    if trainer.is_global_zero:
        atomic_write_json(plan.run_dir / "summary.json", summarize(plan, trainer, callbacks, fit_s, tested))
    return plan.run_dir


def build_datamodule(recipe: Recipe) -> ImageDataModule:
    """The data module, its data found (or downloaded), decoded into the cache and split."""
    dm = ImageDataModule(
        recipe.data_dir, download=recipe.download, img_size=recipe.img_size, batch_size=recipe.batch_size,
        eval_batch_size=recipe.eval_batch_size, val_size=recipe.val_size, seed=recipe.seed,
        augment=asdict(recipe.augment), cache_dir=recipe.cache_dir, max_train_images=recipe.max_train_images,
        max_test_images=recipe.max_test_images)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def build_module(plan: RunPlan, dm: ImageDataModule) -> ImageClassifier:
    """The LightningModule around ``zoo.create_model``; a new run computes its patch-whitening filters (if the
    model has any) from the training images, and one with ``init_from`` starts from those weights."""
    recipe = plan.recipe
    module = ImageClassifier(
        recipe.model, model_args(recipe), num_classes=dm.num_classes, lr=recipe.lr, weight_decay=recipe.weight_decay,
        warmup_frac=min(recipe.warmup_epochs / max(recipe.epochs, 1), 1.0), min_lr_ratio=recipe.min_lr_ratio,
        label_smoothing=recipe.label_smoothing, channels_last=uses_channels_last(recipe), compile=recipe.compile,
        optimizer=recipe.optimizer, muon_dtype=recipe.muon_dtype, momentum=recipe.momentum,
        no_decay_lr_scale=recipe.no_decay_lr_scale, schedule=recipe.schedule, tta=recipe.tta)
    # a resumed run's checkpoint holds its filters; fit_whitening=false keeps the random ones (the ablation)
    if plan.resume_from is None and module.whitening_layers and recipe.fit_whitening:
        module.fit_whitening(dm.normalize(dm.train_dataset.images[:WHITENING_IMAGES]))
    if recipe.init_from and plan.resume_from is None:
        print(init_from(module.model, recipe.init_from, allow_partial=recipe.init_partial).summary())
    return module


def build_callbacks(plan: RunPlan, spent_s: float = 0.0) -> RunCallbacks:
    """Checkpoints (best by val/top1; last every N steps, every few minutes and at the end), throughput
    (checkpoint writes excluded), progress, LR log, the EMA of the weights (``EMAWeightAveraging``:
    validation, checkpoints and the test see the average), the time budget (less ``spent_s``, what the run spent
    before the fit: the precision probe, building the model and its whitening filters)."""
    recipe, ckpt_dir, writes = plan.recipe, plan.run_dir / "checkpoints", AtomicCheckpointIO()
    best = ModelCheckpoint(ckpt_dir, "best", monitor="val/top1", mode="max", save_top_k=1,
                           enable_version_counter=False)
    # last.ckpt every N steps and, with save_last, when the fit ends however it ends (Lightning's on_train_end)
    steps = ModelCheckpoint(ckpt_dir, "last", save_top_k=0, save_last=True,
                            every_n_train_steps=recipe.ckpt_every_n_steps, enable_version_counter=False)
    # and every few minutes of training, not after every validation: on a GPU an epoch takes seconds, and writing
    # the weights and optimizer state that often would cost more than training
    callbacks = [best, steps]
    if recipe.ckpt_every_minutes > 0:
        interval = timedelta(minutes=recipe.ckpt_every_minutes)
        callbacks.append(ModelCheckpoint(ckpt_dir, "last", train_time_interval=interval, enable_version_counter=False))
    throughput = Throughput(writes)
    callbacks += [throughput, LossProgressBar(refresh_rate=1 if plan.accelerator == "cpu" else 20),
                  LearningRateMonitor("step"), ValidationClock()]
    if recipe.ema_decay:
        callbacks.append(EMAWeightAveraging(recipe.ema_decay))
    # a signal saves last.ckpt at the step it arrives; checkpoints hold the random states (exact resume)
    callbacks += [RandomStates(), PreemptionCheckpoint(ckpt_dir / "last.ckpt")]
    if recipe.max_time:
        callbacks += [TimeBudget(parse_max_time(recipe.max_time) - spent_s), Timer(recipe.max_time)]
    return RunCallbacks(best, throughput, callbacks, writes)


def build_trainer(plan: RunPlan, callbacks: RunCallbacks) -> pl.Trainer:
    """The Lightning Trainer: metrics.csv kept across resumes (and the recipe's other loggers), atomic checkpoint
    writes, no sanity check."""
    recipe = plan.recipe
    return pl.Trainer(
        accelerator=plan.accelerator, devices=recipe.devices, strategy=recipe.strategy,
        num_nodes=recipe.num_nodes, precision=plan.precision, max_epochs=recipe.epochs,
        logger=build_loggers(recipe.loggers, plan.run_dir, plan.resume_from), callbacks=callbacks.all,
        plugins=[callbacks.checkpoint_io], limit_train_batches=recipe.limit_train_batches,
        limit_val_batches=recipe.limit_val_batches, limit_test_batches=recipe.limit_test_batches,
        log_every_n_steps=min(50, recipe.ckpt_every_n_steps), num_sanity_val_steps=0)


def run_test(trainer: pl.Trainer, module: ImageClassifier, dm: ImageDataModule, best: ModelCheckpoint) -> dict:
    """Test the best checkpoint (the last weights when there is none): summary.json's test keys.
    ``test_loss_smoothed`` is the training objective (label-smoothed cross-entropy, with the recipe's test-time
    augmentation), not the plain cross-entropy eval.py reports as ``test_cross_entropy``."""
    tested = best.best_model_path if best.best_model_path and Path(best.best_model_path).exists() else None
    # A checkpoint's state_dict holds the EMA weights (the ones validation scored and load_run / eval.py read),
    # but WeightAveraging.on_load_checkpoint would swap the raw weights back in for the test: it steps aside.
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, WeightAveraging)]
    results = trainer.test(module, datamodule=dm, ckpt_path=tested)[0]
    return {"test_top1": float(results["test/top1"]), "test_top5": float(results["test/top5"]),
            "test_loss_smoothed": float(results["test/loss"]), "tested_checkpoint": Path(tested or "last").name}


def summarize(plan: RunPlan, trainer: pl.Trainer, callbacks: RunCallbacks, fit_s: float, tested: dict) -> dict:
    """summary.json: the model, hardware, training progress and speed, accuracies and the data's facts."""
    info, dm = model_info(trainer.lightning_module.model), trainer.datamodule
    best_score = callbacks.best.best_model_score
    return {
        "model": plan.recipe.model, "params": info["params"], "flops": info["flops"], "precision": plan.precision,
        "accelerator": plan.accelerator, "devices": trainer.num_devices * trainer.num_nodes,
        "epochs": trainer.current_epoch, "global_step": trainer.global_step, "wall_time_s": round(fit_s, 2),
        "train_images_per_s": round(callbacks.throughput.images_per_s, 1),
        "best_val_top1": float(best_score) if best_score is not None else None, **tested,
        "label_smoothing": plan.recipe.label_smoothing,
        "num_classes": dm.num_classes, "class_names": list(dm.class_names), "img_size": dm.img_size,
        "mean": list(dm.mean), "std": list(dm.std), "machine": machine_name(plan.accelerator),
        "float32_matmul_precision": torch.get_float32_matmul_precision(), "optimizer": plan.recipe.optimizer,
        "muon_dtype": plan.recipe.muon_dtype,
        **({"peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30} if plan.accelerator == "gpu" else {}),
    }
