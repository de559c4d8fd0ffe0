"""Knowledge distillation as DeiT trains its students (Touvron et al. 2021, https://arxiv.org/abs/2012.12877, and
its reference ``DistillationLoss``): a frozen teacher sees the same augmented batch, and the student's loss is
``(1 - weight) * its own loss + weight * the distillation term``, where the term is

- ``hard``: cross-entropy against the teacher's top class (DeiT's hard-label distillation, no label smoothing);
- ``soft``: ``KL(softmax(teacher / T) || softmax(student / T)) * T**2``, summed and divided by the logits'
  element count, as DeiT's reference does.

The teacher is ``pretrained:NAME`` (weights the zoo ships), a run directory or a checkpoint written by train.py
(``--teacher``); it must predict the data's classes at the run's image size. Its forward runs without gradients,
in eval mode, outside the student's state_dict (a checkpoint holds the student alone)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DISTILL_KINDS = ("hard", "soft")
PRETRAINED = "pretrained:"


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    """The distillation term of (B, C) student and teacher logits (float32), as described in the module."""
    if kind == "hard":
        return F.cross_entropy(student.float(), teacher.argmax(dim=1))
    t = temperature
    kl = F.kl_div(F.log_softmax(student.float() / t, dim=1), F.log_softmax(teacher.float() / t, dim=1),
                  reduction="sum", log_target=True)
    return kl * (t * t) / student.numel()


def load_teacher(spec: str, num_classes: int, img_size: int) -> nn.Module:
    """The frozen teacher named by ``spec``, checked against the run's classes and image size; ValueError in one
    line naming ``--teacher`` when it cannot teach this run."""
    from ..models import create_model, list_models, load_run

    if spec.startswith(PRETRAINED):
        name = spec[len(PRETRAINED):]
        if name not in list_models():
            raise ValueError(f"--teacher {spec}: no model named {name!r} (train.py --list-models)")
        teacher = create_model(name, pretrained=True)
    else:
        teacher, _ = load_run(spec)
    classes = getattr(teacher, "num_classes", None)
    if classes != num_classes:
        raise ValueError(f"--teacher {spec} predicts {classes} classes; the data have {num_classes}")
    size = getattr(teacher, "img_size", None)
    if size is not None and tuple(size if isinstance(size, (tuple, list)) else (size, size)) != (img_size, img_size):
        raise ValueError(f"--teacher {spec} takes {tuple(size)} images; this run trains at {img_size}x{img_size}: "
                         f"set --img-size to the teacher's")
    return teacher.eval().requires_grad_(False)
