"""The optimizer side of ``compile: step``: after the compiled forward, loss and backward of
``step.compiled_train_loss`` (and under DDP the gradient all-reduce beside it), ``CompiledStep`` runs one compiled
graph (``torch.compile(fullgraph=True)``, so no graph break) of the optimizer step (AdamW with ``foreach`` and
``capturable``, or the batched Muon of ``optim.MuonAdamW``, each learning rate a device tensor), the EMA of the
weights (``optim.EMA.update``, handed in through ``after_step``) and the next step's learning rate, computed on the
device from the step count (``schedule_value``: ``optim.WarmupDecay`` in tensor arithmetic). Nothing in the step
reads a device value on the host, and the rate changing step after step compiles nothing new.

``compile_cache_dir`` is where Inductor keeps what it compiled, so a second run of the recipe on the machine loads
its kernels instead of compiling them."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .optim import WarmupDecay, unwrapped_step

__all__ = ["CompiledStep", "compile_cache_dir", "inductor_cache_counts", "schedule_value", "use_compile_cache"]

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def schedule_value(step: torch.Tensor, warmup: torch.Tensor, total: torch.Tensor, min_ratio: float,
                   shape: str) -> torch.Tensor:
    """``WarmupDecay(warmup, total, min_ratio, shape)(step)`` on 0-dim float tensors: linear warm-up
    ``(step + 1) / (warmup + 1)``, then cosine or linear decay to ``min_ratio`` at ``total``, held there after."""
    span = torch.clamp(total - warmup, min=1.0)
    progress = torch.clamp((step - warmup) / span, max=1.0)
    left = 0.5 * (1 + torch.cos(math.pi * progress)) if shape == "cosine" else 1.0 - progress
    return torch.where(step < warmup, (step + 1) / (warmup + 1), min_ratio + (1 - min_ratio) * left)


class CompiledStep(torch.optim.Optimizer):
    """``inner`` (an optimizer whose groups' ``lr`` are 0-dim device tensors, AdamW with ``capturable=True``)
    stepped by one compiled graph: ``step(closure)`` runs the closure (forward and backward) eagerly, then the
    graph of the update, the ``after_step`` functions (the EMA) and the learning rate of the next step,
    ``base_lr * schedule(step count)``, written into the groups' tensors. It shares ``inner``'s groups and state,
    and its ``state_dict`` holds plain-number rates and ``capturable: False`` as an eager run's does (checkpoints
    load either way). ``sync_schedule`` sets the step count and rewrites the rates from the host (at the start of
    a run and when the time budget refits the schedule); ``compile_s``: the seconds of the first step, which
    compiles."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner
        super().__init__(inner.param_groups, {})  # the same group dicts
        self.state = inner.state
        device = inner.param_groups[0]["params"][0].device
        self.count = torch.zeros((), device=device)  # optimizer steps taken (the schedule's step)
        self.warmup = torch.zeros((), device=device)
        self.total = torch.ones((), device=device)
        self.schedule: WarmupDecay | None = None
        self.base_lrs: list[float] = []
        self.after_step: list[Callable[[], None]] = []
        self.compile_s: float | None = None
        self._graph = None

    def _share(self) -> None:
        self.inner.param_groups, self.inner.state = self.param_groups, self.state
        if hasattr(self.inner, "_share"):  # MuonAdamW: its two optimizers point at the new groups too
            self.inner._share()

    def state_dict(self) -> dict:
        state = super().state_dict()
        for group, live in zip(state["param_groups"], self.param_groups, strict=True):
            group["lr"] = float(live["lr"])  # read at checkpoints only
            if "capturable" in group:
                group["capturable"] = False
            if isinstance(group.get("initial_lr"), torch.Tensor):
                group["initial_lr"] = float(group["initial_lr"])
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        rates = [group["lr"] for group in self.param_groups]  # the tensors the graph reads keep their identity
        super().load_state_dict(state_dict)
        for group, rate in zip(self.param_groups, rates, strict=True):
            rate.fill_(float(group["lr"]))
            group["lr"] = rate
            if "capturable" in group:
                group["capturable"] = True
            for p in group["params"]:  # capturable: the step counts live beside the parameters
                if "step" in self.state.get(p, {}):
                    self.state[p]["step"] = self.state[p]["step"].to(p.device, torch.float32)
        self._share()

    def sync_schedule(self, schedule: WarmupDecay, base_lrs: list[float], steps: int) -> None:
        """Take the schedule's fields, the groups' base rates and the optimizer steps taken (``steps``), and write
        the rates of the next step (host writes, no read)."""
        self.schedule = schedule
        self.base_lrs = [float(lr) for lr in base_lrs]
        self.count.fill_(steps)
        self.warmup.fill_(self.schedule.warmup_steps)
        self.total.fill_(self.schedule.total_steps)
        value = self.schedule(steps)
        for group, base in zip(self.param_groups, self.base_lrs, strict=True):
            group["lr"].fill_(base * value)

    @torch.no_grad()
    def _update(self) -> None:
        unwrapped_step(self.inner)()
        for fn in self.after_step:
            fn()
        self.count.add_(1)
        value = schedule_value(self.count, self.warmup, self.total, self.schedule.min_ratio, self.schedule.shape)
        for group, base in zip(self.param_groups, self.base_lrs, strict=True):
            group["lr"].copy_(value * base)

    def step(self, closure=None):
        if self.schedule is None:
            raise RuntimeError("CompiledStep.sync_schedule must run before the first step")
        start = time.perf_counter()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._graph is None:
            self._graph = torch.compile(self._update, fullgraph=True)
        self._graph()
        if self.compile_s is None:
            self.compile_s = time.perf_counter() - start
        return loss


def compile_cache_dir(root: Path, accelerator: str, machine: str, settings: dict) -> Path:
    """``root/compile/<model>-<hash>``: one folder per torch version, device (``machine``: the CPU model or the
    GPU's name) and the recipe's model and compile settings (``settings``, JSON-able)."""
    key = json.dumps({"torch": torch.__version__, "accelerator": accelerator, "machine": machine, **settings},
                     sort_keys=True, default=str)
    return root / "compile" / f"{settings.get('model', 'model')}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def use_compile_cache(folder: Path) -> Path:
    """Point Inductor's cache (its FX graph and AOTAutograd caches, the Triton kernels on a GPU) at ``folder``,
    unless ``TORCHINDUCTOR_CACHE_DIR`` names another folder already (the user's choice is kept); returns the
    folder in use."""
    from torch._inductor.runtime.runtime_utils import default_cache_dir

    current = os.environ.get(INDUCTOR_CACHE_ENV)
    if current and current != default_cache_dir():
        return Path(current)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_CACHE_ENV] = str(folder)
    return folder


def inductor_cache_counts() -> dict[str, int]:
    """This process's hits and misses of Inductor's FX graph cache so far (``compile_cache_hits`` /
    ``compile_cache_misses``): compiled graphs loaded from the cache folder, and compiled anew."""
    from torch._dynamo.utils import counters

    return {"compile_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "compile_cache_misses": counters["inductor"]["fxgraph_cache_miss"]}
