"""Lightning training for the zoo: ``ImageClassifier`` (label-smoothed cross-entropy, AdamW with linear
warm-up then cosine decay, torchmetrics top-1 / top-5), ``TimeBudget`` (fits the schedule to ``--max-time``)
and ``fit`` (one resumable run: Trainer, callbacks, checkpoints, summary). Recipes follow DeiT
(https://arxiv.org/abs/2012.12877): AdamW, cosine schedule, label smoothing, no weight decay on norms,
biases, position embeddings and the class token."""

from __future__ import annotations

import math
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, Timer, TQDMProgressBar
from timm.optim import param_groups_weight_decay
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from .bench import synchronize
from .models import create_model, model_info

STAGES = ("train", "val", "test")


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN / inf loss; the message names the first bad optimizer step."""


class WarmupCosine:
    """LR multiplier per optimizer step: linear warm-up from 0 over ``warmup_steps``, then cosine decay to
    ``min_ratio`` at ``total_steps`` (held there after). A callable object, so LambdaLR's state_dict saves
    its fields and a resumed run continues the same (possibly re-fitted) schedule."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.0):
        self.warmup_steps, self.total_steps, self.min_ratio = int(warmup_steps), int(total_steps), min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class ImageClassifier(pl.LightningModule):
    """A zoo model trained for classification. Batches are ``(images (B, 3, H, W) float, targets)`` with
    targets int64 ``(B,)`` or class probabilities ``(B, num_classes)`` (mixup / cutmix).

    Args:
        model_name / model_args: ``zoo.create_model(model_name, num_classes=num_classes, **model_args)``;
            saved as hyperparameters so a checkpoint rebuilds its model.
        warmup_frac: fraction of the optimizer steps spent in linear warm-up.
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``.
        nan_check_every: steps between host-side checks of the non-finite-loss flag (every checkpoint
            checks too, so a NaN model is never saved); ``None`` -> 1 on CPU, 50 on GPU.
    """

    def __init__(self, model_name: str, model_args: dict | None = None, *, num_classes: int = 10,
                 lr: float = 1e-3, weight_decay: float = 0.05, warmup_frac: float = 0.05,
                 min_lr_ratio: float = 0.01, label_smoothing: float = 0.0, channels_last: bool = False,
                 compile: bool = False, nan_check_every: int | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.model = create_model(model_name, num_classes=num_classes, **(model_args or {}))
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        if channels_last:
            self.model.to(memory_format=torch.channels_last)
        if compile:
            self.model.compile()
        top5 = min(5, num_classes)
        self.metrics = torch.nn.ModuleDict({
            f"{stage}_acc": MetricCollection({
                "top1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                "top5": MulticlassAccuracy(num_classes, top_k=top5, average="micro"),
            }, prefix=f"{stage}/")
            for stage in STAGES
        })
        # first optimizer step whose loss was not finite (-1: none); a device buffer, so no host sync per step
        self.register_buffer("first_bad_step", torch.tensor(-1, dtype=torch.long), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images.contiguous(memory_format=self.memory_format))

    def _shared_step(self, batch, stage: str) -> torch.Tensor:
        images, targets = batch
        logits = self(images)
        loss = F.cross_entropy(logits.float(), targets, label_smoothing=self.hparams.label_smoothing)
        labels = targets.argmax(dim=1) if targets.ndim == 2 else targets
        metrics = self.metrics[f"{stage}_acc"]
        metrics.update(logits.detach(), labels)
        self.log(f"{stage}/loss", loss.detach(), on_step=stage == "train", on_epoch=True, prog_bar=True,
                 sync_dist=stage != "train", batch_size=images.shape[0])
        self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=stage != "train")
        return loss

    def training_step(self, batch, batch_idx):
        loss = self._shared_step(batch, "train")
        bad = ~torch.isfinite(loss.detach()) & (self.first_bad_step < 0)
        self.first_bad_step = torch.where(bad, torch.tensor(self.global_step, device=loss.device),
                                          self.first_bad_step)
        every = self.hparams.nan_check_every or (1 if loss.device.type == "cpu" else 50)
        if self.global_step % every == 0:
            self.check_finite()
        return loss

    def validation_step(self, batch, batch_idx):
        self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._shared_step(batch, "test")

    def check_finite(self) -> None:
        """Raise NonFiniteLossError if any loss so far was NaN / inf (one host sync)."""
        step = int(self.first_bad_step)
        if step >= 0:
            raise NonFiniteLossError(
                f"non-finite training loss at optimizer step {step}; stopped (the last checkpoint written is "
                "from before it). Lower --lr, add warm-up or use --precision 32")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.check_finite()  # never write a checkpoint of a model that saw a NaN loss
        for logger in self.loggers:
            logger.save()  # metrics.csv keeps the history up to every checkpoint, even if the run is killed

    def configure_optimizers(self):
        no_decay = getattr(self.model, "no_weight_decay", lambda: set())()
        groups = param_groups_weight_decay(self.model, self.hparams.weight_decay,
                                           no_weight_decay_list=no_decay)
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, fused=self.device.type == "cuda")
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        schedule = WarmupCosine(round(total * self.hparams.warmup_frac), total, self.hparams.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def refit_schedule(self, total_steps: int) -> None:
        """Stretch / shrink warm-up + cosine to end at ``total_steps`` (the time budget's estimate)."""
        schedule = self.lr_schedulers().lr_lambdas[0]
        schedule.total_steps = max(int(total_steps), self.global_step + 1)
        schedule.warmup_steps = round(schedule.total_steps * self.hparams.warmup_frac)


class TimeBudget(pl.Callback):
    """Fits the LR schedule to a wall-clock budget and stops training in time for the test.

    After ``measure_steps`` optimizer steps it measures the step time, estimates how many steps fit in what
    is left of ``budget_s`` once validation (one pass per epoch) and the final test are paid for, and
    re-fits warm-up + cosine to that; it re-fits after every validation with the measured validation time,
    and stops training when the fitted step count is reached. Its state travels in checkpoints."""

    def __init__(self, budget_s: float, measure_steps: int = 20, skip_steps: int = 5):
        self.budget_s, self.measure_steps, self.skip_steps = budget_s, measure_steps, skip_steps
        self.step_time: float | None = None
        self.val_time: float | None = None
        self.total_steps: int | None = None
        self.elapsed_before = 0.0  # budget spent by earlier (killed) parts of a resumed run
        self._t0 = self._skip_t = self._val_t = None

    def state_dict(self) -> dict:
        return {"step_time": self.step_time, "val_time": self.val_time, "total_steps": self.total_steps,
                "elapsed": self.elapsed()}

    def load_state_dict(self, state: dict) -> None:
        self.step_time, self.val_time = state["step_time"], state["val_time"]
        self.total_steps = state["total_steps"]
        self.elapsed_before = state["elapsed"]

    def elapsed(self) -> float:
        return self.elapsed_before + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    def on_train_start(self, trainer, pl_module):
        self._t0 = time.perf_counter()
        self._start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        done = trainer.global_step - self._start_step
        if done == self.skip_steps:
            synchronize(pl_module.device)
            self._skip_t = time.perf_counter()
        elif done == self.skip_steps + self.measure_steps and self.step_time is None:
            synchronize(pl_module.device)
            self.step_time = (time.perf_counter() - self._skip_t) / self.measure_steps
            self._refit(trainer, pl_module)
        if self.total_steps is not None and trainer.global_step >= self.total_steps:
            trainer.should_stop = True

    def on_validation_start(self, trainer, pl_module):
        self._val_t = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or self._val_t is None:
            return
        self.val_time = time.perf_counter() - self._val_t
        if self.step_time is not None:
            self._refit(trainer, pl_module)

    def _refit(self, trainer, pl_module) -> None:
        steps_per_epoch = max(trainer.num_training_batches // trainer.accumulate_grad_batches, 1)
        # before validation was measured: a forward pass costs about a third of a training step
        val_time = self.val_time if self.val_time is not None else (
            self.step_time / 3 * _num_batches(trainer.num_val_batches))
        test_time = val_time * 1.5  # test set is about as large as val; margin for loading best weights
        left = self.budget_s - self.elapsed() - test_time - val_time
        more = max(int(left / (self.step_time + val_time / steps_per_epoch)), 1)
        self.total_steps = trainer.global_step + more
        pl_module.refit_schedule(self.total_steps)


def _num_batches(counts) -> float:
    counts = counts if isinstance(counts, list) else [counts]
    return float(sum(c for c in counts if math.isfinite(c)))


class Throughput(pl.Callback):
    """Training images per second over the whole fit, validation time excluded."""

    def __init__(self):
        self.images = 0
        self.train_s = 0.0
        self._t = None

    def on_train_epoch_start(self, trainer, pl_module):
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.images += batch[0].shape[0] * trainer.world_size

    def on_validation_start(self, trainer, pl_module):
        self._pause(pl_module.device)

    def on_validation_end(self, trainer, pl_module):
        self._t = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        self._pause(pl_module.device)

    def _pause(self, device: torch.device):
        if self._t is not None:
            synchronize(device)
            self.train_s += time.perf_counter() - self._t
            self._t = None

    @property
    def images_per_s(self) -> float:
        return self.images / self.train_s if self.train_s > 0 else 0.0


def resolve_precision(precision: str, accelerator: str) -> str:
    """``auto`` -> bf16-mixed on GPUs that support it, 16-mixed on other GPUs, 32 on CPU."""
    if precision != "auto":
        return precision
    if accelerator == "gpu":
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32"


def resolve_accelerator(accelerator: str, devices) -> str:
    """``auto`` -> gpu when CUDA is visible, else cpu; a GPU request that cannot be met -> ValueError."""
    if accelerator in ("auto", "gpu", "cuda"):
        available = torch.cuda.device_count()
        if accelerator == "auto":
            accelerator = "gpu" if available else "cpu"
        elif not available:
            raise ValueError(f"--accelerator {accelerator} requested but no CUDA GPU is visible; "
                             "use --accelerator cpu")
        else:
            accelerator = "gpu"
        if accelerator == "gpu" and isinstance(devices, int) and devices > available:
            raise ValueError(f"--devices {devices} asks for more GPUs than exist ({available} visible)")
    return accelerator


def fit(cfg: dict) -> Path:
    """Train one run from a resolved config (``zoo.config.resolve_config``) and return its run directory,
    which holds config.yaml, metrics.csv, checkpoints/{last,best}.ckpt and summary.json. With
    ``cfg["resume"]`` ("auto" or a run directory / checkpoint) the run continues where its last.ckpt ends."""
    from .config import parse_max_time
    from .data import ImageDataModule
    from .runs import AtomicCheckpointIO, ResumableCSVLogger, load_pretrained, prepare_run_dir, write_json

    accelerator = resolve_accelerator(cfg["accelerator"], cfg["devices"])
    precision = resolve_precision(cfg["precision"], accelerator)
    dm = ImageDataModule(
        cfg["data_dir"], download=cfg["download"], img_size=cfg["img_size"], batch_size=cfg["batch_size"],
        eval_batch_size=cfg["eval_batch_size"], val_size=cfg["val_size"], seed=cfg["seed"],
        augment=cfg["augment"], cache_dir=cfg["cache_dir"], max_train_images=cfg["max_train_images"],
        max_test_images=cfg["max_test_images"])
    dm.prepare_data()
    dm.setup("fit")
    run_dir, ckpt_path = prepare_run_dir(cfg)
    pl.seed_everything(cfg["seed"], workers=True, verbose=False)

    channels_last = cfg["channels_last"]
    if channels_last == "auto":
        channels_last = accelerator == "gpu" and cfg["model"].startswith(("resnet", "hybrid"))
    model_args = {**cfg["model_args"], "img_size": cfg["img_size"]}  # every zoo model takes img_size
    module = ImageClassifier(
        cfg["model"], model_args, num_classes=dm.num_classes, lr=cfg["lr"],
        weight_decay=cfg["weight_decay"],
        warmup_frac=min(cfg["warmup_epochs"] / max(cfg["epochs"], 1), 1.0), min_lr_ratio=cfg["min_lr_ratio"],
        label_smoothing=cfg["label_smoothing"], channels_last=bool(channels_last), compile=cfg["compile"])
    if cfg["init_from"] and ckpt_path is None:
        load_pretrained(module.model, cfg["init_from"])

    ckpt_dir = run_dir / "checkpoints"
    best = ModelCheckpoint(ckpt_dir, "best", monitor="val/top1", mode="max", save_top_k=1, save_last=True,
                           enable_version_counter=False)
    steps = ModelCheckpoint(ckpt_dir, "last", save_top_k=0, save_last=True,
                            every_n_train_steps=cfg["ckpt_every_n_steps"], enable_version_counter=False)
    throughput = Throughput()
    callbacks = [best, steps, throughput, TQDMProgressBar(refresh_rate=1 if accelerator == "cpu" else 20),
                 LearningRateMonitor("step")]
    if cfg["max_time"]:
        callbacks += [TimeBudget(parse_max_time(cfg["max_time"])), Timer(cfg["max_time"])]
    logger = ResumableCSVLogger(run_dir, resume_from=ckpt_path)

    trainer = pl.Trainer(
        accelerator=accelerator, devices=cfg["devices"], strategy=cfg["strategy"], num_nodes=cfg["num_nodes"],
        precision=precision, max_epochs=cfg["epochs"], logger=logger, callbacks=callbacks,
        plugins=[AtomicCheckpointIO()], limit_train_batches=cfg["limit_train_batches"],
        limit_val_batches=cfg["limit_val_batches"], limit_test_batches=cfg["limit_test_batches"],
        log_every_n_steps=min(50, cfg["ckpt_every_n_steps"]),
        num_sanity_val_steps=0)
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt_path) if ckpt_path else None)
    fit_s = time.perf_counter() - start
    tested = best.best_model_path if best.best_model_path and Path(best.best_model_path).exists() else None
    results = trainer.test(module, datamodule=dm, ckpt_path=tested)[0]

    if trainer.is_global_zero:
        info = model_info(module.model)
        write_json(run_dir / "summary.json", {
            "model": cfg["model"], "params": info["params"], "flops": info["flops"], "precision": precision,
            "accelerator": accelerator, "devices": trainer.num_devices * trainer.num_nodes,
            "epochs": trainer.current_epoch, "global_step": trainer.global_step,
            "wall_time_s": round(fit_s, 2),
            "train_images_per_s": round(throughput.images_per_s, 1),
            "best_val_top1": float(best.best_model_score) if best.best_model_score is not None else None,
            "test_top1": float(results["test/top1"]), "test_top5": float(results["test/top5"]),
            "test_loss": float(results["test/loss"]), "tested_checkpoint": Path(tested or "last").name,
            "num_classes": dm.num_classes, "class_names": list(dm.class_names), "img_size": dm.img_size,
            "mean": list(dm.mean), "std": list(dm.std),
        })
    return run_dir
