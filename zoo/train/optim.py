"""Optimisation pieces of a recipe: parameter groups (no weight decay and an optional learning-rate scale for
norms, biases, position tables and class tokens, as timm and airbench split them), the optimiser (AdamW or
SGD with Nesterov momentum), the warm-up + decay schedule fitted to the run, and the exponential moving average
of the weights with a warm-up of its decay (airbench's Lookahead / EMA, Polyak averaging)."""

from __future__ import annotations

import math

import torch
from timm.optim import param_groups_weight_decay
from torch import nn

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "linear")


class WarmupDecay:
    """LR multiplier per optimizer step: linear warm-up from 0 over ``warmup_steps``, then a cosine or linear
    decay to ``min_ratio`` at ``total_steps`` (held there after). A callable object, so LambdaLR's state_dict
    saves its fields and a resumed run continues the same (possibly re-fitted) schedule."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.0, shape: str = "cosine"):
        if shape not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {shape!r}")
        self.warmup_steps, self.total_steps, self.min_ratio = int(warmup_steps), int(total_steps), min_ratio
        self.shape = shape

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        left = 0.5 * (1 + math.cos(math.pi * progress)) if self.shape == "cosine" else 1.0 - progress
        return self.min_ratio + (1 - self.min_ratio) * left


class WarmupCosine(WarmupDecay):
    """``WarmupDecay`` with the cosine shape."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.0):
        super().__init__(warmup_steps, total_steps, min_ratio, "cosine")


def param_groups(model: nn.Module, lr: float, weight_decay: float, no_decay_lr_scale: float = 1.0) -> list[dict]:
    """timm's two groups: weights with ``weight_decay``, and 1-D parameters (norms, biases) plus the model's
    ``no_weight_decay()`` names without it, at ``lr * no_decay_lr_scale``."""
    no_decay = getattr(model, "no_weight_decay", lambda: set())()
    groups = param_groups_weight_decay(model, weight_decay, no_weight_decay_list=no_decay)
    for group in groups:
        group["lr"] = lr * (no_decay_lr_scale if group["weight_decay"] == 0 else 1.0)
    return groups


def build_optimizer(name: str, groups: list[dict], lr: float, *, momentum: float = 0.9,
                    fused: bool = False) -> torch.optim.Optimizer:
    """AdamW (torch's defaults otherwise) or SGD with Nesterov ``momentum``, over ``groups``."""
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, fused=fused)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True, fused=fused)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def ema_avg_fn(decay: float):
    """``torch.optim.swa_utils.AveragedModel`` averaging function: an EMA whose decay warms up as
    ``min(decay, (1 + n) / (10 + n))`` after n updates, so the average follows the fast early changes."""
    if not 0.0 < decay < 1.0:
        raise ValueError(f"ema_decay must lie in (0, 1), got {decay!r}")

    def average(averaged: torch.Tensor, current: torch.Tensor, num_averaged) -> torch.Tensor:
        n = float(num_averaged)
        d = min(decay, (1.0 + n) / (10.0 + n))
        return averaged + (current - averaged) * (1.0 - d)

    return average
