"""``ImageClassifier``, a LightningModule for users who train a zoo model with their own ``lightning.Trainer``:
its steps are the zoo's loop's (``zoo.train.step``: label-smoothed cross-entropy, test-time augmentation in
validation and test), its optimizer the recipe's (AdamW, Nesterov SGD or Muon with timm's parameter groups) with
linear warm-up then cosine or linear decay over the Trainer's steps, and its top-1 / top-5 torchmetrics'. A
checkpoint written by train.py loads into it (``ImageClassifier.load_from_checkpoint``), and one it writes into
``zoo.load_run`` and eval.py. Batches are ``(images (B, 3, H, W) float, normalised, targets)`` with targets int64
``(B,)`` or class probabilities ``(B, num_classes)``. The Trainer's own callbacks add the rest (an EMA with
``WeightAveraging``, checkpoints, a time limit); the zoo's loop (``zoo.train.loop``) does not use this class."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from ..models import create_model
from ..runtime.device import resolve_muon_dtype
from .optim import WarmupDecay, build_optimizer, param_groups
from .step import eval_loss, train_loss

ACCELERATORS = {"cuda": "gpu", "mps": "mps"}  # Lightning's accelerator name of a torch device type


class ImageClassifier(pl.LightningModule):
    """A zoo model trained for classification by a ``lightning.Trainer``.

    Args:
        model_name / model_args: ``zoo.create_model(model_name, num_classes=num_classes, **model_args)``; saved as
            hyper-parameters, so a checkpoint rebuilds its model.
        lr, weight_decay, no_decay_lr_scale, optimizer, momentum, muon_dtype: as the recipe's keys of those names
            (``zoo.train.optim.build_optimizer``; Muon leaves the classifier to AdamW).
        warmup_frac: fraction of the Trainer's optimizer steps spent in linear warm-up; the decay ends at
            ``lr * min_lr_ratio`` (``schedule``: "cosine" or "linear").
        label_smoothing: of the cross-entropy, in training, validation and test.
        tta: test-time augmentation level of validation and test (``zoo.models.tta``).
        channels_last: the model and its inputs in channels-last memory.
    """

    def __init__(self, model_name: str, model_args: dict | None = None, *, num_classes: int = 10,
                 lr: float = 1e-3, weight_decay: float = 0.05, warmup_frac: float = 0.05,
                 min_lr_ratio: float = 0.01, schedule: str = "cosine", label_smoothing: float = 0.0,
                 optimizer: str = "adamw", momentum: float = 0.9, no_decay_lr_scale: float = 1.0,
                 muon_dtype: str = "auto", tta: int = 0, channels_last: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.model = create_model(model_name, num_classes=num_classes, **(model_args or {}))
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.model.to(memory_format=self.memory_format)
        top5 = min(5, num_classes)
        self.metrics = torch.nn.ModuleDict({  # by f"{stage}_acc": a ModuleDict key "train" would hide Module.train
            f"{stage}_acc": MetricCollection({"top1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                                     "top5": MulticlassAccuracy(num_classes, top_k=top5, average="micro")},
                                    prefix=f"{stage}/")
            for stage in ("train", "val", "test")})
        # a batch-size-weighted mean whose float sums are reduced across ranks
        self.losses = torch.nn.ModuleDict({f"{stage}_loss": MeanMetric() for stage in ("val", "test")})

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images.contiguous(memory_format=self.memory_format))

    def training_step(self, batch, batch_idx):
        images, targets = batch
        loss, logits = train_loss(self.model, images, targets, self.hparams.label_smoothing, self.memory_format)
        labels = targets.argmax(dim=1) if targets.ndim == 2 else targets
        self.metrics["train_acc"].update(logits.detach(), labels)
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=True, batch_size=len(images))
        self.log_dict(self.metrics["train_acc"], on_step=False, on_epoch=True)
        return loss

    def _eval_step(self, batch, stage: str) -> torch.Tensor:
        images, labels = batch
        loss, logits = eval_loss(self.model, images, labels, self.hparams.label_smoothing, self.hparams.tta,
                                 self.memory_format)
        self.metrics[f"{stage}_acc"].update(logits.detach(), labels)
        self.losses[f"{stage}_loss"].update(loss.detach(), len(images))
        self.log(f"{stage}/loss", self.losses[f"{stage}_loss"], on_step=False, on_epoch=True, prog_bar=True)
        self.log_dict(self.metrics[f"{stage}_acc"], on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        return self._eval_step(batch, "val")

    def test_step(self, batch, batch_idx):
        return self._eval_step(batch, "test")

    def configure_optimizers(self):
        hp = self.hparams
        groups = param_groups(self.model, hp.lr, hp.weight_decay, hp.no_decay_lr_scale)
        optimizer = build_optimizer(hp.optimizer, groups, hp.lr, momentum=hp.momentum,
                                    muon_exclude={id(p) for p in self.model.get_classifier().parameters()},
                                    muon_dtype=resolve_muon_dtype(hp.muon_dtype,
                                                                  ACCELERATORS.get(self.device.type, "cpu")))
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        schedule = WarmupDecay(round(total * hp.warmup_frac), total, hp.min_lr_ratio, hp.schedule)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
