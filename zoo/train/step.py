"""The steps of training and evaluation, shared by the zoo's loop (``zoo.train.loop``) and its LightningModule
(``zoo.train.module.ImageClassifier``): ``train_loss`` (the forward and the label-smoothed cross-entropy of a
training batch, a teacher's distillation term mixed in), ``compiled_train_loss`` (the same as one compiled graph,
``compile: step``), ``eval_loss`` (a validation or test batch under test-time augmentation) and ``Totals`` (top-1,
top-5, the mean loss and the image count of an epoch or an evaluation as device tensors: no host read per batch,
summed across processes once, and a state a checkpoint holds so a resumed epoch counts every batch of it).

Targets are int64 class indices (B,) or class probabilities (B, num_classes) (mixup / cutmix); losses are computed
in float32 whatever the forward's precision."""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..models.tta import tta_logits
from .distill import distillation_loss


def train_loss(model: nn.Module, images: torch.Tensor, targets: torch.Tensor, label_smoothing: float,
               memory_format: torch.memory_format = torch.contiguous_format,
               teacher_logits: torch.Tensor | None = None,
               distill: tuple[str, float, float] = ("hard", 0.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, logits)`` of a training batch: label-smoothed cross-entropy in float32; with ``teacher_logits``,
    mixed with the distillation term, ``distill`` = (kind, weight, temperature) (``zoo.train.distill``)."""
    logits = model(images.contiguous(memory_format=memory_format))
    loss = F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing)
    if teacher_logits is not None:
        kind, weight, temperature = distill
        loss = (1 - weight) * loss + weight * distillation_loss(logits, teacher_logits, kind, temperature)
    return loss, logits


@functools.cache
def compiled_train_loss(device_type: str):
    """``train_loss`` compiled once per device type (its backward compiled with it); on CUDA with CUDA graphs
    (torch's "reduce-overhead"), whose outputs the next replay overwrites, so they are returned as copies."""
    if device_type != "cuda":
        return torch.compile(train_loss)
    graphed = torch.compile(train_loss, mode="reduce-overhead")

    def step(*args):
        torch.compiler.cudagraph_mark_step_begin()  # one training step per call: earlier outputs may be reused
        loss, logits = graphed(*args)
        return loss.clone(), logits.detach().clone()
    return step


def eval_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, label_smoothing: float, tta: int,
              memory_format: torch.memory_format = torch.contiguous_format) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, logits)`` of a validation or test batch under test-time augmentation level ``tta``
    (``zoo.models.tta``); the loss is the training objective (label-smoothed)."""
    logits = tta_logits(lambda x: model(x.contiguous(memory_format=memory_format)), images, tta)
    return F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing), logits


def low_res(images: torch.Tensor, size: int) -> torch.Tensor:
    """A batch resized to ``size`` x ``size`` for progressive resizing (bilinear, antialiased)."""
    return F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)


def check_takes_size(model: nn.Module, name: str, size: int) -> None:
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


class Totals:
    """Sums over the batches of an epoch or an evaluation, kept on ``device``: the loss times the batch's images,
    the images whose label is the top-1 / among the top-5 (at most ``num_classes``) logits, and the images.
    ``add`` reads nothing on the host; ``compute`` reads once (and, given ``all_reduce``, sums the ranks' totals
    first: every image counts once, whatever the number of processes); ``state_dict`` / ``load_state_dict`` carry
    an epoch's totals through a checkpoint, so the resumed epoch's sums are the uninterrupted epoch's, to the bit
    (the same additions in the same order)."""

    KEYS = ("loss", "top1", "top5", "images")

    def __init__(self, num_classes: int, device: torch.device):
        self.top_k = min(5, num_classes)
        self.sums = torch.zeros(len(self.KEYS), dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Count a batch: ``labels`` int64 (B,) or class probabilities (B, num_classes) (scored by their argmax)."""
        if labels.ndim == 2:
            labels = labels.argmax(dim=1)
        with torch.no_grad():
            top = logits.detach().float().topk(self.top_k, dim=1).indices
            hits = top == labels[:, None]
            count = self.sums.new_full((), labels.numel())  # a fill on the device, not a copy from the host
            self.sums += torch.stack([loss.detach().double() * count, hits[:, 0].sum().double(),
                                      hits.any(dim=1).sum().double(), count])

    def compute(self, all_reduce=None) -> dict[str, float]:
        """``{"loss": mean loss, "top1": fraction, "top5": fraction, "images": count}`` (fractions in [0, 1]);
        ``all_reduce``: a function summing a tensor over the processes (``fabric.all_reduce(t, reduce_op="sum")``)."""
        sums = all_reduce(self.sums.clone()) if all_reduce is not None else self.sums
        loss, top1, top5, images = sums.tolist()
        n = max(images, 1.0)
        return {"loss": loss / n, "top1": top1 / n, "top5": top5 / n, "images": int(images)}

    @property
    def empty(self) -> bool:
        """Whether nothing was counted (one host read)."""
        return bool(self.sums[3] == 0)

    def state_dict(self) -> dict:
        return {"sums": self.sums.detach().cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        self.sums = state["sums"].to(self.sums.device, torch.float64)
