"""Optimisation pieces of a recipe: parameter groups (no weight decay and an optional learning-rate scale for
norms, biases, position tables and class tokens, as timm and airbench split them), the optimiser (AdamW, SGD
with Nesterov momentum, or torch's Muon on the 2-D weight matrices, with ``muon_conv`` on the conv filters
too, and AdamW on the rest), the warm-up + decay schedule fitted to the run (``WarmupDecay``, applied by
``set_rates``), and the exponential moving average of the weights with a warm-up of its decay (``EMA``: airbench's
Lookahead / EMA, Polyak averaging)."""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable

import torch
from timm.optim import param_groups_weight_decay
from torch import nn
from torch.optim._muon import _adjust_lr

OPTIMIZERS = ("adamw", "sgd", "muon", "muon_conv")
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


def muon_split(groups: list[dict], exclude: set[int] = frozenset(), *, filters: bool = False
               ) -> tuple[list[dict], list[dict]]:
    """``param_groups``' groups split for ``MuonAdamW``: the 2-D weights of the decayed groups (with ``filters``
    the conv filters, and any other weight of more dimensions, too), less the parameters whose ``id`` is in
    ``exclude`` (e.g. the classifier's, as Muon's authors keep heads on AdamW), for Muon; everything else
    (norms, biases, tables; conv filters without ``filters``) for AdamW; group settings are kept."""
    muon, adamw = [], []
    for group in groups:
        on_muon = [group["weight_decay"] > 0 and (p.ndim == 2 or (filters and p.ndim > 2)) and id(p) not in exclude
                   for p in group["params"]]
        to_muon = [p for p, m in zip(group["params"], on_muon, strict=True) if m]
        rest = [p for p, m in zip(group["params"], on_muon, strict=True) if not m]
        muon += [{**group, "params": to_muon}] if to_muon else []
        adamw += [{**group, "params": rest}] if rest else []
    return muon, adamw


def _matrix(tensor: torch.Tensor, like: torch.Tensor, view: bool) -> torch.Tensor:
    """``tensor`` (shaped as the parameter ``like``) as the matrix (shape[0], the rest), read in ``like``'s memory
    order: a channels_last filter as (out, kH * kW * in), so the parameter's matrix is a view of it. Muon's
    iteration does not mind the column order: it commutes with any permutation of the columns."""
    if like.ndim == 4 and not like.is_contiguous() and like.is_contiguous(memory_format=torch.channels_last):
        tensor = tensor.permute(0, 2, 3, 1)
    return tensor.view(tensor.shape[0], -1) if view else tensor.reshape(tensor.shape[0], -1)


MUON_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def newton_schulz(updates, steps: int, coefficients: tuple[float, float, float], eps: float,
                  dtype: torch.dtype, workspace: dict | None = None) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration (Keller Jordan's coefficients, as torch's Muon) on a stack of
    same-shape matrices ``(k, m, n)`` (or a sequence of k ``(m, n)`` matrices) at once, computed in ``dtype``: each
    matrix is scaled to Frobenius norm 1, then ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, ``steps`` times, on
    the wide orientation (a tall stack is iterated as its transpose). Returns ``(k, m, n)`` in ``dtype``: ~ U S' V^T
    of each input. With ``workspace`` (a dict kept between calls) the buffers are reused and the result lives in
    it until the next call with the same shapes."""
    a, b, c = coefficients
    first = updates[0]
    tall = first.size(-2) > first.size(-1)
    wide = [matrix.mT if tall else matrix for matrix in updates]
    shape, device = (len(wide), *wide[0].shape), first.device
    m = shape[1]
    x, spare, gram, poly = (_buffer(workspace, name, size, dtype, device) for name, size in
                            (("x", shape), ("spare", shape), ("gram", (shape[0], m, m)), ("poly", (shape[0], m, m))))
    torch.stack(wide, out=x)  # the cast to dtype happens in the copy
    x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_(min=eps))
    for _ in range(steps):
        torch.bmm(x, x.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        torch.baddbmm(x, poly, x, beta=a, out=spare)
        x, spare = spare, x
    return x.mT if tall else x


def _buffer(workspace: dict | None, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """A buffer of ``workspace`` reused from call to call: on a CPU, memory freshly taken from the system costs a
    page fault per 4 KiB on first touch, which made the iteration's copies and divisions cost as much as its
    matmuls when every step allocated new stacks."""
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    key = (name, shape, dtype, device)
    if key not in workspace:
        workspace[key] = torch.empty(shape, dtype=dtype, device=device)
    return workspace[key]


def _wide(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` in its wide orientation (a view): the iteration runs there, so (m, n) and (n, m) batch as one."""
    return matrix.mT if matrix.size(-2) > matrix.size(-1) else matrix


class FilterMuon(torch.optim.Muon):
    """torch's Muon on parameters of two or more dimensions, each updated as the matrix (shape[0], the rest):
    Keller Jordan's rule for conv filters (airbench's Muon). The update is torch's Muon's (Nesterov momentum,
    decoupled weight decay, its learning-rate adjustment per shape), but the Newton-Schulz iteration runs once
    per shape over all matrices of a group with that shape or its transpose (``newton_schulz``, batched as the
    CIFAR speedruns do),
    in ``ns_dtype`` rather than torch's fixed bf16: float32 on a device that only emulates bf16. The momentum
    buffer of a filter is kept as its matrix."""

    def __init__(self, params, lr: float, *, momentum: float = 0.95, ns_dtype: torch.dtype = torch.bfloat16):
        # torch's Muon checks its settings, then refuses tensors that are not 2-D: take the checked defaults
        defaults = torch.optim.Muon([torch.zeros(1, 1)], lr=lr, momentum=momentum, nesterov=True,
                                    adjust_lr_fn="match_rms_adamw").defaults
        if ns_dtype not in MUON_DTYPES.values():
            raise ValueError(f"ns_dtype must be torch.float32 or torch.bfloat16, got {ns_dtype!r}")
        self.ns_dtype = ns_dtype  # not a group setting: a checkpoint resumed elsewhere takes the new device's
        self._workspace: dict = {}  # newton_schulz's buffers, reused step after step (not state: never saved)
        torch.optim.Optimizer.__init__(self, params, defaults)

    def _init_group(self, group, params_with_grad, grads, muon_momentum_bufs) -> bool:
        """The parameters with a gradient, their gradients and momentum buffers (as matrices); the parameters and
        gradients as they are (``step`` takes their matrices: made there, the views are part of a compiled step's
        graph rather than inputs aliasing the parameters)."""
        for p in group["params"]:
            if p.grad is None:
                continue
            params_with_grad.append(p)
            grads.append(p.grad)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(_matrix(p, p, view=False),
                                                            memory_format=torch.contiguous_format)
            muon_momentum_bufs.append(state["momentum_buffer"])
        return False  # no complex parameters

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None):
        """One step; with a GradScaler's ``grad_scale`` and ``found_inf`` (0-dim device tensors), the gradients
        are unscaled and the step leaves parameters and momentum as they were where ``found_inf`` is 1, decided
        on the device (no host read)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        keep = 1.0 if found_inf is None else 1 - found_inf  # 0 (skip the step) or 1, as a device tensor
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            if not params:
                continue
            grads = [_matrix(g, p, view=False) for g, p in zip(grads, params, strict=True)]
            params = [_matrix(p, p, view=True) for p in params]  # in-place updates of the view reach p
            if found_inf is not None:  # non-finite gradients zeroed: times a zero weight they would still be NaN
                scale = 1.0 if grad_scale is None else grad_scale  # None: unscaled already (scaler.unscale_)
                grads = [torch.where(g.isfinite(), g / scale, 0.0) for g in grads]
            lr, momentum = group["lr"], group["momentum"]
            weight = (1 - momentum) * keep  # a tensor weight as a list: the 0-dim overload reads it on the host
            torch._foreach_lerp_(buffers, grads, weight if found_inf is None else [weight] * len(grads))
            updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"] * keep)
            by_shape: dict[tuple[int, ...], list[int]] = {}  # one iteration per wide shape: (m, n) with (n, m)
            for i, update in enumerate(updates):
                by_shape.setdefault(tuple(_wide(update).shape), []).append(i)
            for members in by_shape.values():
                ortho = newton_schulz([_wide(updates[i]) for i in members], group["ns_steps"],
                                      group["ns_coefficients"], group["eps"], self.ns_dtype, self._workspace)
                for i, matrix in zip(members, ortho.unbind(0), strict=True):
                    rate = _adjust_lr(lr, group["adjust_lr_fn"], params[i].shape)
                    step = matrix if found_inf is None else matrix * keep
                    if isinstance(rate, torch.Tensor):  # a compiled step's rate, a device tensor: no host read
                        _wide(params[i]).sub_(step * rate)
                    else:
                        _wide(params[i]).add_(step, alpha=-rate)
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two: ``FilterMuon`` (torch's Muon: Nesterov ``momentum``, its ``"match_rms_adamw"`` rate
    adjustment, so one ``lr`` suits both, as in Moonshot's Muon) on ``muon_groups`` (matrices and filters) and
    ``torch.optim.AdamW`` on ``adamw_groups``. Lightning's automatic optimisation and ``LambdaLR`` see one
    optimizer whose ``param_groups`` are the two's (the same dicts), and ``state_dict`` / ``load_state_dict``
    round-trip both."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], lr: float, *, momentum: float = 0.95,
                 fused: bool = False, ns_dtype: torch.dtype = torch.bfloat16, compiled: bool = False):
        self.muon = FilterMuon(muon_groups, lr=lr, momentum=momentum, ns_dtype=ns_dtype)
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, fused=fused, **_compiled_adamw(compiled))
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._share()

    def _share(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state  # keyed by parameter: the two sets do not overlap

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # builds new group dicts and state: point the two at them again
        self._share()

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """With a fused AdamW, a GradScaler (16-mixed) hands this optimizer its scale and inf flag as tensors
        (``grad_scale``, ``found_inf``) instead of reading the flag on the host before each step: fused AdamW
        and ``FilterMuon`` unscale and skip on the device."""
        return bool(self.adamw.defaults["fused"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaling = {"grad_scale": getattr(self, "grad_scale", None), "found_inf": getattr(self, "found_inf", None)}
        self.muon.step(**scaling)
        if scaling["grad_scale"] is None and scaling["found_inf"] is None:
            unwrapped_step(self.adamw)()  # under this step's no_grad; one graph when compiled (no torch wrapper)
            return loss
        vars(self.adamw).update(scaling)  # where torch's Adam(W).step reads a GradScaler's tensors
        try:
            self.adamw.step()
        finally:
            del self.adamw.grad_scale, self.adamw.found_inf
        return loss


def unwrapped_step(optimizer: torch.optim.Optimizer) -> Callable[[], object]:
    """``optimizer.step`` without torch's wrappers (the profiler hook, and ``_use_grad_for_differentiable``, whose
    two ``torch._dynamo.graph_break()`` calls would split a compiled step): the caller holds ``torch.no_grad``."""
    return inspect.unwrap(type(optimizer).step).__get__(optimizer)


class NothingToStep(ValueError):
    """A Muon optimizer asked of a model with no tensor of the kind it steps (muon: weight matrices)."""


def build_optimizer(name: str, groups: list[dict], lr: float, *, momentum: float = 0.9,
                    fused: bool = False, muon_exclude: set[int] = frozenset(),
                    muon_dtype: str = "bfloat16", compiled: bool = False) -> torch.optim.Optimizer:
    """AdamW (torch's defaults otherwise), SGD with Nesterov ``momentum``, or ``MuonAdamW`` (the 2-D
    weights not in ``muon_exclude`` on Muon; ``muon_conv``: the conv filters too; its iteration in
    ``muon_dtype``, "float32" or "bfloat16"), over ``groups``. ``compiled``: stepped inside ``torch.compile``
    (``compile: step``), so AdamW runs ``foreach`` with ``capturable`` (its step count and bias corrections stay
    device tensors, the rate may be one) and nothing is fused. A Muon optimizer with no tensor of its kind ->
    ``NothingToStep``."""
    fused = fused and not compiled
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, fused=fused, **_compiled_adamw(compiled))
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True, fused=fused,
                               foreach=True if compiled else None)
    if name in ("muon", "muon_conv"):
        split = muon_split(groups, muon_exclude, filters=name == "muon_conv")
        if not split[0]:  # torch would fail later on an empty parameter list, in its own words
            raise NothingToStep(f"optimizer {name} finds no weight matrix for Muon in this model (its weights are conv "
                             "filters or the classifier's): use --optimizer muon_conv (filters too) or adamw")
        if muon_dtype not in MUON_DTYPES:
            raise ValueError(f"muon_dtype must be one of {tuple(MUON_DTYPES)}, got {muon_dtype!r}")
        return MuonAdamW(*split, lr, momentum=momentum, fused=fused, ns_dtype=MUON_DTYPES[muon_dtype],
                         compiled=compiled)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def _compiled_adamw(compiled: bool) -> dict:
    """AdamW's options when a compiled graph steps it (``build_optimizer``'s ``compiled``)."""
    return {"foreach": True, "capturable": True} if compiled else {}


def ema_multi_avg_fn(decay: float):
    """``torch.optim.swa_utils.AveragedModel``'s ``multi_avg_fn``: an EMA of lists of same-dtype tensors in
    place, with foreach ops and the update count ``num_averaged`` as a device tensor, so it never reads a value
    on the host. The first update (n = 0) copies; later ones keep ``min(decay, (1 + n) / (10 + n))`` of the
    average after n earlier updates, a warm-up of the decay so the average follows the fast early changes."""
    if not 0.0 < decay < 1.0:
        raise ValueError(f"ema_decay must lie in (0, 1), got {decay!r}")

    @torch.no_grad()
    def average(averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor) -> None:
        n = num_averaged.to(averaged[0].dtype)
        kept = torch.where(n == 0, 0.0, ((1 + n) / (10 + n)).clamp(max=decay))  # 0-dim, on the device
        torch._foreach_mul_(averaged, kept)
        torch._foreach_add_(averaged, torch._foreach_mul(current, 1 - kept))  # kept = 0: exactly a copy

    return average


def set_rates(optimizer: torch.optim.Optimizer, base_lrs: list[float], multiplier: float) -> None:
    """Each group's learning rate set to its base rate times ``multiplier`` (the schedule's value for the step)."""
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base * multiplier


class EMA:
    """An exponential moving average of ``model``'s floating-point parameters and buffers (integer buffers follow
    the model, as ``torch.optim.swa_utils.AveragedModel`` copies them), by ``ema_multi_avg_fn(decay)`` with the
    update count on the device: ``update`` after every optimizer step reads nothing on the host. The average lives
    in tensors beside the model's, in its ``state_dict`` order and names; ``swapped_in`` puts it into the model for
    a block (validation, the test and a checkpoint's weights see the average, as Lightning's ``WeightAveraging``
    has them) and the trained weights back after it."""

    def __init__(self, model: nn.Module, decay: float):
        self.average_fn = ema_multi_avg_fn(decay)
        # keep_vars: the parameters themselves, not detached aliases (a compiled step would copy every one in and out)
        self.live = dict(model.state_dict(keep_vars=True))
        self.averaged = {name: tensor.detach().clone() for name, tensor in self.live.items()}
        first = next(iter(self.live.values()))
        self.count = torch.zeros((), dtype=torch.long, device=first.device)
        self._groups: dict[torch.dtype, tuple[list, list]] = {}
        self._copied: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, current in self.live.items():
            averaged = self.averaged[name]
            if averaged.is_floating_point():
                lists = self._groups.setdefault(averaged.dtype, ([], []))
                lists[0].append(averaged)
                lists[1].append(current)
            else:
                self._copied.append((averaged, current))

    @torch.no_grad()
    def update(self) -> None:
        for averaged, current in self._copied:
            averaged.copy_(current)
        for averaged, current in self._groups.values():
            self.average_fn(averaged, current, self.count)
        self.count.add_(1)

    @contextlib.contextmanager
    def swapped_in(self):
        """The model holds the average inside the block, its trained weights again after it."""
        with torch.no_grad():
            trained = {name: tensor.detach().clone() for name, tensor in self.live.items()}
            for name, tensor in self.live.items():
                tensor.copy_(self.averaged[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, tensor in self.live.items():
                    tensor.copy_(trained[name])

    def state_dict(self) -> dict:
        return {"averaged": {name: t.detach().clone() for name, t in self.averaged.items()}, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for name, tensor in self.averaged.items():
                tensor.copy_(state["averaged"][name])
            self.count.copy_(state["count"])
