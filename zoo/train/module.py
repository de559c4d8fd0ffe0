"""The LightningModule of the zoo: ``ImageClassifier`` (label-smoothed cross-entropy, AdamW or Nesterov SGD
with linear warm-up then cosine or linear decay, torchmetrics top-1 / top-5, test-time augmentation in
validation and test, patch-whitening filters computed from the training images when the model has them).
Recipes follow DeiT (https://arxiv.org/abs/2012.12877) and airbench (https://arxiv.org/abs/2404.00498): no
weight decay on norms, biases, position embeddings and the class token, label smoothing."""

from __future__ import annotations

import contextlib
import copy
import functools

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from ..layers.whitening import PatchWhitening
from ..models import compile_regions, create_model
from .compiled import CompiledStep, StepSchedule
from .device import accelerator_of, forked_generators, host_sync_every, resolve_muon_dtype
from .distill import distillation_loss
from .optim import WarmupCosine, WarmupDecay, build_optimizer, param_groups
from .tta import tta_logits

__all__ = ["ImageClassifier", "NonFiniteLossError", "WarmupCosine", "WarmupDecay"]

STAGES = ("train", "val", "test")
# devices whose optimizers run fused: one kernel per step, and a GradScaler's inf check stays on the device
FUSED_OPTIMIZER_DEVICES = ("cuda", "mps")


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN / inf loss; the message names the first bad optimizer step."""


def train_loss(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor, label_smoothing: float,
               memory_format: torch.memory_format, teacher_logits: torch.Tensor | None = None,
               distill: tuple[str, float, float] = ("hard", 0.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, logits)`` of a training batch: label-smoothed cross-entropy in float32 (targets as in
    ``ImageClassifier``); with ``teacher_logits``, mixed with the distillation term, ``distill`` = (kind, weight,
    temperature) (``zoo.train.distill``)."""
    logits = model(images.contiguous(memory_format=memory_format))
    loss = F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing)
    if teacher_logits is not None:
        kind, weight, temperature = distill
        loss = (1 - weight) * loss + weight * distillation_loss(logits, teacher_logits, kind, temperature)
    return loss, logits


@functools.cache
def compiled_train_loss(device_type: str):
    """``train_loss`` compiled once per device type; on CUDA with CUDA graphs (torch's "reduce-overhead"), whose
    outputs the next replay overwrites, so they are returned as copies."""
    if device_type != "cuda":
        return torch.compile(train_loss)
    graphed = torch.compile(train_loss, mode="reduce-overhead")

    def step(*args):
        torch.compiler.cudagraph_mark_step_begin()  # one training step per call: earlier outputs may be reused
        loss, logits = graphed(*args)
        return loss.clone(), logits.detach().clone()
    return step


def check_takes_size(model: torch.nn.Module, name: str, size: int) -> None:
    """ValueError unless ``model`` takes (1, C, size, size) images (one forward on the meta device: no compute)."""
    meta = model if any(p.is_meta for p in model.parameters()) else copy.deepcopy(model).to("meta")
    meta.eval()
    try:
        with torch.no_grad():
            meta(torch.empty(1, getattr(model, "in_chans", 3), size, size, device="meta"))
    except (ValueError, RuntimeError, AssertionError) as err:
        hint = (" (a ViT takes it with model_args.dynamic_img_size: true)"
                if getattr(model, "dynamic_img_size", None) is False else "")
        raise ValueError(f"low_res_size {size}: {name} does not take {size}x{size} images{hint}: "
                         f"{str(err).splitlines()[0]}") from None


class ImageClassifier(pl.LightningModule):
    """A zoo model trained for classification. Batches are ``(images (B, 3, H, W) float, targets)`` with
    targets int64 ``(B,)`` or class probabilities ``(B, num_classes)`` (mixup / cutmix).

    Args:
        model_name / model_args: ``zoo.create_model(model_name, num_classes=num_classes, **model_args)``;
            saved as hyperparameters so a checkpoint rebuilds its model.
        warmup_frac: fraction of the optimizer steps spent in linear warm-up.
        min_lr_ratio: the decay ends at ``lr * min_lr_ratio``.
        optimizer: "adamw", "sgd" (Nesterov, ``momentum``), "muon" (``optim.MuonAdamW``: Muon on the 2-D
            weights but the classifier's) or "muon_conv" (and on the conv filters); ``no_decay_lr_scale``
            multiplies the rate of norms, biases and the model's ``no_weight_decay()`` parameters.
        muon_dtype: "float32" or "bfloat16", the dtype of Muon's Newton-Schulz iteration; "auto": bfloat16 where
            the device computes it natively (``zoo.train.device.resolve_muon_dtype``), else float32.
        schedule: "cosine" or "linear" decay after the warm-up.
        compile: True compiles the whole model (``Module.compile``), "regions" each CBAM and transformer block
            (``zoo.models.compile_regions``: seconds to compile, the convolutions stay eager), "step" the
            training step's forward and loss as one graph whose backward inductor compiles too
            (``compiled_train_loss``: replayed as CUDA graphs on CUDA, so without gradient accumulation; under
            DDP, dynamo splits it at the gradient buckets), and the optimizer step, the EMA of the weights and
            the learning rate as a second graph (``zoo.train.compiled.CompiledStep``); evaluation eager.
        tta: test-time augmentation level of validation and test (``zoo.train.tta``: 0 none, 1 mirror,
            2 mirror + 1-pixel translations).
        nan_check_every: steps between host-side checks of the non-finite-loss flag (every checkpoint
            checks too, so a NaN model is never saved); ``None`` -> 1 on CPU, 50 on GPU.
        distill, distill_weight, distill_temperature: how a teacher set with ``set_teacher`` teaches
            (``zoo.train.distill``); without one they do nothing.
        low_res_size, low_res_until: progressive resizing (FixRes, Touvron et al. 2019,
            https://arxiv.org/abs/1906.06423; fast.ai's and Composer's progressive resizing): the first
            ``low_res_until`` of the training steps (``low_res_steps``, refitted with the schedule until the
            switch) train on images resized to low_res_size x low_res_size (bilinear, antialiased), the rest at
            full size; a teacher sees the full-size images. The model must take that size (ValueError naming
            the setting otherwise: a ViT takes it with ``dynamic_img_size=True``). Validation and test: full size.
    """

    def __init__(self, model_name: str, model_args: dict | None = None, *, num_classes: int = 10,
                 lr: float = 1e-3, weight_decay: float = 0.05, warmup_frac: float = 0.05,
                 min_lr_ratio: float = 0.01, label_smoothing: float = 0.0, channels_last: bool = False,
                 compile: bool | str = False, nan_check_every: int | None = None, optimizer: str = "adamw",
                 momentum: float = 0.9, no_decay_lr_scale: float = 1.0, schedule: str = "cosine", tta: int = 0,
                 muon_dtype: str = "auto", distill: str = "hard", distill_weight: float = 0.5,
                 distill_temperature: float = 1.0, low_res_size: int | None = None, low_res_until: float = 0.75):
        super().__init__()
        self.save_hyperparameters()
        self.model = create_model(model_name, num_classes=num_classes, **(model_args or {}))
        if low_res_size:
            check_takes_size(self.model, model_name, low_res_size)
        self.low_res_steps = 0  # training steps before the switch to full size (0: no progressive resizing)
        self.low_res_cost = 1.0  # a full-size step's cost over a low-res one, estimated: the ratio of pixels
        self._restored_low_res_steps: int | None = None
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        if channels_last:
            self.model.to(memory_format=torch.channels_last)
        if compile == "regions":
            compile_regions(self.model)
        elif compile and compile != "step":
            self.model.compile()
        top5 = min(5, num_classes)
        self.metrics = torch.nn.ModuleDict({
            f"{stage}_acc": MetricCollection({
                "top1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                "top5": MulticlassAccuracy(num_classes, top_k=top5, average="micro"),
            }, prefix=f"{stage}/")
            for stage in STAGES
        })
        # Validation / test loss as a batch-size-weighted mean whose float sums are reduced across ranks (Lightning's
        # own mean of a logged tensor divides its integer image count by the world size under gloo, truncating)
        self.eval_losses = torch.nn.ModuleDict({stage: MeanMetric() for stage in STAGES[1:]})
        # first optimizer step whose loss was not finite (-1: none); a device buffer, so no host sync per step
        self.register_buffer("first_bad_step", torch.tensor(-1, dtype=torch.long), persistent=False)
        # each rank keeps its own flag (DDP would overwrite it with rank 0's at every forward); check_finite reduces
        self._ddp_params_and_buffers_to_ignore = ["first_bad_step"]
        self._teacher: tuple[torch.nn.Module, ...] = ()  # in a tuple: no submodule, so in no state_dict or DDP

    def set_teacher(self, teacher: torch.nn.Module | None) -> None:
        """Distil from ``teacher`` (frozen, eval mode; ``zoo.train.distill.load_teacher``), or from none."""
        self._teacher = (teacher,) if teacher is not None else ()

    def teacher_logits(self, images: torch.Tensor) -> torch.Tensor | None:
        """The teacher's logits of a training batch (no gradient), or None without a teacher."""
        if not self._teacher:
            return None
        with torch.no_grad():
            return self._teacher[0](images)

    @property
    def eval_passes(self) -> int:
        """Forward passes per validation / test image (test-time augmentation makes several)."""
        return {0: 1, 1: 2, 2: 6}[self.hparams.tta]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images.contiguous(memory_format=self.memory_format))

    def rank_own_draws(self):
        """Under several processes, the training forward's own random draws (dropout, drop path) made apart on each
        rank: inside, the generators are seeded from one draw every rank makes alike plus the rank, and outside they
        stay equal on every rank (the augmentation draws for the global batch, and resume is exact). One process, or
        the CUDA-graphed step (whose replays keep their own generator offsets), draws as it is."""
        world = self._trainer.world_size if self._trainer is not None else 1
        if world == 1 or (self.hparams.compile == "step" and self.device.type == "cuda"):
            return contextlib.nullcontext()
        base = int(torch.randint(2**31, ()))  # torch's CPU generator: a host value, no wait for the device
        return forked_generators(self.device, base * world + self._trainer.global_rank)

    def train_images(self, images: torch.Tensor) -> torch.Tensor:
        """A training batch at the size this step trains at: before ``low_res_steps``, resized to
        low_res_size (progressive resizing), else as given."""
        size = self.hparams.low_res_size
        if not size or self.global_step >= self.low_res_steps:
            return images
        self.low_res_cost = images.shape[-2] * images.shape[-1] / size**2
        return F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)

    def _shared_step(self, batch, stage: str) -> torch.Tensor:
        images, targets = batch
        with self.rank_own_draws() if stage == "train" else contextlib.nullcontext():
            hp = self.hparams
            if stage == "train" and (hp.compile == "step" or self._teacher):
                loss_fn = compiled_train_loss(images.device.type) if hp.compile == "step" else train_loss
                loss, logits = loss_fn(self.model, self.train_images(images), targets, hp.label_smoothing,
                                       self.memory_format, self.teacher_logits(images),
                                       (hp.distill, hp.distill_weight, hp.distill_temperature))
            else:
                logits = (self(self.train_images(images)) if stage == "train"
                          else tta_logits(self, images, self.hparams.tta))
                loss = F.cross_entropy(logits.float(), targets, label_smoothing=self.hparams.label_smoothing)
        labels = targets.argmax(dim=1) if targets.ndim == 2 else targets
        metrics = self.metrics[f"{stage}_acc"]
        metrics.update(logits.detach(), labels)
        if stage == "train":  # off Lightning's progress-bar dict, which becomes Python numbers after every batch
            # (a host sync per step): callbacks.LossProgressBar shows it when the bar refreshes
            self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, batch_size=images.shape[0])
        else:
            self.eval_losses[stage].update(loss.detach(), images.shape[0])
            self.log(f"{stage}/loss", self.eval_losses[stage], on_step=False, on_epoch=True, prog_bar=True)
        self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=stage != "train")
        return loss

    def training_step(self, batch, batch_idx):
        loss = self._shared_step(batch, "train")
        bad = ~torch.isfinite(loss.detach()) & (self.first_bad_step < 0)
        # the step number filled in on the device (a kernel argument), not copied from host memory
        self.first_bad_step = torch.where(bad, torch.full_like(self.first_bad_step, self.global_step),
                                          self.first_bad_step)
        every = self.hparams.nan_check_every or host_sync_every(loss.device.type)
        if self.global_step % every == 0:
            self.check_finite()
        return loss

    def validation_step(self, batch, batch_idx):
        self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._shared_step(batch, "test")

    def check_finite(self) -> None:
        """Raise NonFiniteLossError if any loss so far was NaN / inf (one host sync). Under several processes the
        ranks' flags are reduced first (every rank calls this at the same steps), so all of them stop together,
        naming the first bad step of any rank."""
        bad = self.first_bad_step
        if self._trainer is not None and self.trainer.world_size > 1:
            never = torch.iinfo(torch.long).max
            bad = self.trainer.strategy.reduce(torch.where(bad < 0, never, bad), reduce_op="min")
            bad = torch.where(bad == never, -1, bad)
        step = int(bad)
        if step >= 0:
            raise NonFiniteLossError(
                f"non-finite training loss at optimizer step {step}; stopped (the last checkpoint written is "
                "from before it). Lower --lr, add warm-up or use --precision 32")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.check_finite()  # never write a checkpoint of a model that saw a NaN loss
        checkpoint["low_res_steps"] = self.low_res_steps
        for logger in self.loggers:
            logger.save()  # metrics.csv keeps the history up to every checkpoint, even if the run is killed

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # configure_optimizers runs after the restore: it keeps the resumed run's switch step
        self._restored_low_res_steps = checkpoint.get("low_res_steps")

    @property
    def whitening_layers(self) -> list[PatchWhitening]:
        """The model's patch-whitening layers (they sit at its input), whose filters come from data."""
        return [m for m in self.model.modules() if isinstance(m, PatchWhitening)]

    @torch.no_grad()
    def fit_whitening(self, images: torch.Tensor) -> None:
        """Compute every whitening filter of the model from (N, C, H, W) normalised training images."""
        for layer in self.whitening_layers:
            layer.fit(images.to(layer.weight.device))

    def on_train_start(self):
        optimizer = self.trainer.optimizers[0] if self.trainer.optimizers else None
        if isinstance(optimizer, CompiledStep):
            optimizer.sync_schedule(self.lr_schedulers(), self.global_step)
            if self.trainer.is_global_zero:
                print("compiling the training step (the first run on this machine takes longer)", flush=True)

    def on_fit_start(self):
        for teacher in self._teacher:  # not a submodule: Lightning did not move it
            teacher.to(self.device)
        # the graphed step's gradients live in CUDA-graph memory that the next replay overwrites: each step must
        # start from no gradients (Lightning's zero_grad sets them to None before each backward)
        if self.hparams.compile == "step" and self.device.type == "cuda" and self.trainer.accumulate_grad_batches > 1:
            raise ValueError("compile='step' replays CUDA graphs, which cannot accumulate gradients: use "
                             "accumulate_grad_batches=1 or another compile mode")

    def configure_optimizers(self):
        hp = self.hparams
        groups = param_groups(self.model, hp.lr, hp.weight_decay, hp.no_decay_lr_scale)
        head = self.model.get_classifier()  # timm's API, which every zoo model has: Muon leaves the head to AdamW
        compiled = hp.compile == "step"
        optimizer = build_optimizer(hp.optimizer, groups, hp.lr, momentum=hp.momentum,
                                    fused=self.device.type in FUSED_OPTIMIZER_DEVICES,
                                    muon_exclude={id(p) for p in head.parameters()},
                                    muon_dtype=resolve_muon_dtype(hp.muon_dtype, accelerator_of(self.device)),
                                    compiled=compiled)
        if compiled:  # the rates as device tensors, which the compiled step writes and reads
            for group in optimizer.param_groups:
                group["lr"] = torch.tensor(float(group["lr"]), device=self.device)
            optimizer = CompiledStep(optimizer)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        schedule = WarmupDecay(round(total * hp.warmup_frac), total, hp.min_lr_ratio, hp.schedule)
        scheduler = (StepSchedule if compiled else torch.optim.lr_scheduler.LambdaLR)(optimizer, schedule)
        if hp.low_res_size:
            restored = self._restored_low_res_steps
            self.low_res_steps = round(total * hp.low_res_until) if restored is None else restored
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def refit_schedule(self, total_steps: int) -> None:
        """Stretch / shrink warm-up + cosine to end at ``total_steps`` (the time budget's estimate)."""
        schedule = self.lr_schedulers().lr_lambdas[0]
        schedule.total_steps = max(int(total_steps), self.global_step + 1)
        schedule.warmup_steps = round(schedule.total_steps * self.hparams.warmup_frac)
        if self.hparams.low_res_size and self.global_step < self.low_res_steps:  # the switch stays where it came
            self.low_res_steps = max(round(schedule.total_steps * self.hparams.low_res_until), self.global_step)
        optimizer = self.trainer.optimizers[0]
        if isinstance(optimizer, CompiledStep):  # the next step's rate, computed before the refit, again
            optimizer.sync_schedule(self.lr_schedulers(), self.global_step)
