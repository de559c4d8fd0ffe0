"""The one clock of a training run (``RunClock``): the wall seconds of the run (earlier parts of a resumed run
included), the seconds spent training (validation and checkpoint writes left out) and the images trained, for
throughput; the step time, measured over windows of steps; the validation pass time; and from them the steps a
``--max-time`` budget buys, which the learning-rate schedule is fitted to.

The budget pays for training and validation (the final test runs after it): the steps that fit are the seconds
left, less the final validation, over a step plus its share of one validation per epoch (``steps_in_budget``).
The step time is first measured over ``MEASURE`` steps after the first ``SKIP`` of each process (those compile and
warm caches), then again over every ``REFIT_EVERY`` steps, and the validation time at every validation, so a
machine that was busy while the first steps were timed, or gets busy later, still ends inside the budget and near
its end. With progressive resizing the steps before the switch and after it have two costs
(``total_steps_in_budget``): a full-size step costs the pixel ratio times a small one until full-size steps
have been timed.

Every reading of the clock goes through ``now``, so a test can script the time."""

from __future__ import annotations

import contextlib
import math
import time

import torch

from ..runtime.timing import synchronize


def now() -> float:
    """The clock's time in seconds (``time.perf_counter``)."""
    return time.perf_counter()


def steps_in_budget(left_s: float, step_time: float, val_time: float, steps_per_epoch: int) -> int:
    """Optimizer steps that fit in ``left_s`` seconds once the final validation and one validation per epoch of
    steps are paid for (at least 1)."""
    return max(int((left_s - val_time) / (step_time + val_time / steps_per_epoch)), 1)


def total_steps_in_budget(done: int, left_s: float, val_time: float, steps_per_epoch: int, low_step_time: float,
                          full_step_time: float, low_share: float) -> int:
    """The schedule's total optimizer steps T of a run with progressive resizing, ``done`` steps run and ``left_s``
    seconds left: steps before ``low_share * T`` take ``low_step_time``, the rest ``full_step_time``, and the final
    validation plus one per epoch of steps are paid for, as in ``steps_in_budget``. Past the switch (``done >=
    low_share * T``) every step left is a full-size one (at least ``done + 1``)."""
    per_val = val_time / steps_per_epoch
    usable = left_s - val_time
    total = (usable + done * (low_step_time + per_val)) / (
        low_share * low_step_time + (1 - low_share) * full_step_time + per_val)
    if low_share * total < done:  # the switch is behind: the steps left are full-size ones
        total = done + usable / (full_step_time + per_val)
    return max(int(total), done + 1)


class RunClock:
    """A run's time, as the module says. The loop calls ``start`` when training starts, ``after_step`` after each
    optimizer step (True when a step time was measured: the budget's fit is made again), ``paused`` around what is
    not training (validation, checkpoint writes) and ``validation`` around each validation pass; ``fit_steps``
    gives the steps the budget buys. ``state_dict`` carries the measured times, the fitted step count, the seconds
    spent and the images trained into a checkpoint.

    Args:
        budget_s: the ``--max-time`` budget in seconds, or None.
        scheduled_steps: the recipe's steps (epochs x steps per epoch): never more are fitted.
        steps_per_epoch / val_batches / eval_passes: what one epoch trains and one validation costs (before a
            validation was timed: a forward pass costs about a third of a training step, times the passes
            test-time augmentation makes).
        low_res_cost: with progressive resizing, a full-size step's cost over a small one's (the pixel ratio),
            until full-size steps are timed; 1 without it.
        low_res_until: the share of the steps before the switch to full size (0 without progressive resizing).
        step_s: a step's seconds as timed before training (the probes), or None: the estimate until measured.
    """

    SKIP, MEASURE, REFIT_EVERY = 5, 20, 50
    FULL_SKIP, FULL_MEASURE = 3, 10

    def __init__(self, *, budget_s: float | None, scheduled_steps: int, steps_per_epoch: int, val_batches: int,
                 eval_passes: int = 1, low_res_cost: float = 1.0, low_res_until: float = 0.0,
                 step_s: float | None = None):
        self.budget_s, self.scheduled_steps = budget_s, scheduled_steps
        self.steps_per_epoch, self.val_batches, self.eval_passes = max(steps_per_epoch, 1), val_batches, eval_passes
        self.low_res_cost, self.low_res_until = low_res_cost, low_res_until
        self.probe_step_s = step_s
        self.step_time: float | None = None  # measured here (a small step before the switch, under resizing)
        self.full_step_time: float | None = None  # a full-size step, measured after the switch
        self.timed_low = False  # whether step_time was measured on small (progressive resizing) steps
        self.val_time: float | None = None
        self.total_steps: int | None = None  # the steps the budget buys, once fitted
        self.elapsed_before = 0.0  # seconds of the run before this process's training started
        self.trained_before, self.images_before = 0.0, 0  # training seconds and images of earlier parts
        self.images = 0  # images trained by this process's part (all ranks')
        self.first_epoch: tuple[int, float] | None = None  # (images, training seconds) after this part's 1st epoch
        self._t0: float | None = None
        self._start_step = 0
        self._paused = 0.0  # seconds of this part outside training (validation, checkpoint writes)
        self._mark: tuple[int, float, float] | None = None  # (step, time, paused) where the timed steps began
        self._full_mark: tuple[int, float, float] | None = None
        self._saved_at = now()  # when this process last wrote last.ckpt (or started)
        self._stopped: tuple[float, float] | None = None  # (time, paused) when training ended

    # ------------------------------------------------------------------ readings

    def start(self, step: int, spent_s: float = 0.0) -> None:
        """Training starts (or resumes) at ``step``; ``spent_s``: seconds this process spent before it (the
        probes, building the model), which the budget paid for."""
        self._t0, self._start_step = now(), step
        self.elapsed_before += spent_s

    def stop(self) -> None:
        """Training ended: the run's seconds, training seconds and images stay as they are now (the test after it
        is not part of them)."""
        self._stopped = (now(), self._paused)

    def _now_and_paused(self) -> tuple[float, float]:
        return self._stopped if self._stopped is not None else (now(), self._paused)

    def elapsed(self) -> float:
        """Seconds of the run so far (until training ended), its earlier parts included."""
        return self.elapsed_before + (self._now_and_paused()[0] - self._t0 if self._t0 is not None else 0.0)

    def checkpoint_written(self) -> None:
        self._saved_at = now()

    def since_checkpoint(self) -> float:
        """Seconds since last.ckpt was last written (or this process started)."""
        return now() - self._saved_at

    def budget_left(self) -> float | None:
        return None if self.budget_s is None else max(self.budget_s - self.elapsed(), 0.0)

    def trained_seconds(self) -> float:
        """Seconds spent training, validation and checkpoint writes left out, earlier parts included."""
        at, paused = self._now_and_paused()
        return self.trained_before + (at - self._t0 - paused if self._t0 is not None else 0.0)

    def images_per_s(self) -> float:
        seconds = self.trained_seconds()
        return (self.images_before + self.images) / seconds if seconds > 0 else 0.0

    def later_images_per_s(self) -> float | None:
        """Images per second after this part's first epoch (which pays for compilation and warm-up), or None."""
        if self.first_epoch is None:
            return None
        images, seconds = self.first_epoch
        spent = self.trained_seconds() - seconds
        return (self.images_before + self.images - images) / spent if spent > 0 else None

    def epoch_ended(self) -> None:
        if self.first_epoch is None:
            self.first_epoch = (self.images_before + self.images, self.trained_seconds())

    @contextlib.contextmanager
    def paused(self, device: torch.device | None = None):
        """What runs inside is not training: its seconds leave throughput and step times out."""
        if device is not None:
            synchronize(device)
        start = now()
        try:
            yield
        finally:
            if device is not None:
                synchronize(device)
            self._paused += now() - start

    @contextlib.contextmanager
    def validation(self, device: torch.device):
        """A validation pass: paused, and its seconds are the validation time from now on."""
        start = now()
        with self.paused(device):
            yield
        self.val_time = now() - start

    # ------------------------------------------------------------------ step times

    def _window(self, mark: tuple[int, float, float], step: int) -> float:
        began_step, began, paused = mark
        return (now() - began - (self._paused - paused)) / (step - began_step)

    def after_step(self, step: int, device: torch.device, switch: int = 0) -> bool:
        """Time the steps (the device synchronised only where a window begins or ends); True when a step time was
        measured now. ``switch``: the step where progressive resizing turns to full size (0: none)."""
        done = step - self._start_step
        if done < self.SKIP:
            return False
        if self._mark is None:  # this process's first timed step: compilation and warm-up are behind
            synchronize(device)
            self._mark = (step, now(), self._paused)
            return False
        measured = False
        if self.step_time is None:
            if step - self._mark[0] >= self.MEASURE:
                synchronize(device)
                self.step_time = self._window(self._mark, step)
                self.timed_low = bool(switch) and step <= switch
                if switch and self._start_step + self.SKIP >= switch:  # all full-size steps already
                    self.full_step_time = self.step_time
                self._mark = (step, now(), self._paused)
                measured = True
        elif step - self._mark[0] >= self.REFIT_EVERY:
            synchronize(device)
            seconds = self._window(self._mark, step)
            began = self._mark[0]
            self._mark = (step, now(), self._paused)
            if not switch or step <= switch:  # a window of one phase: small steps, or no resizing
                self.step_time, measured = seconds, True
            elif began >= switch + self.FULL_SKIP:  # full-size steps, past the ones that compile
                self.full_step_time, measured = seconds, True
        if switch and self.step_time is not None and self.full_step_time is None and step > switch:
            if step - switch == self.FULL_SKIP:
                synchronize(device)
                self._full_mark = (step, now(), self._paused)
            elif self._full_mark is not None and step - self._full_mark[0] >= self.FULL_MEASURE:
                synchronize(device)
                self.full_step_time, measured = self._window(self._full_mark, step), True
        return measured

    def step_times(self) -> tuple[float, float] | None:
        """Seconds of a small (progressive resizing) step and of a full-size one (equal without resizing), from
        the measured times, else the probe's (a full-size step); None when neither is known."""
        if self.step_time is None:
            if self.probe_step_s is None:
                return None
            return self.probe_step_s / self.low_res_cost, self.probe_step_s
        if self.timed_low:
            return self.step_time, self.full_step_time or self.step_time * self.low_res_cost
        return self.step_time / self.low_res_cost, self.step_time

    def val_seconds(self) -> float:
        """A validation pass's seconds: measured, else a third of a full-size step per batch and TTA pass."""
        if self.val_time is not None:
            return self.val_time
        times = self.step_times()
        return 0.0 if times is None else times[1] / 3 * self.eval_passes * self.val_batches

    # ------------------------------------------------------------------ the budget

    def fit_steps(self, step: int, switch: int = 0) -> int:
        """The steps the budget buys, ``step`` done (at most the recipe's); the recipe's without a budget or before
        any step time is known. ``switch``: the step where progressive resizing turns to full size."""
        times = self.step_times()
        left = self.budget_left()
        if left is None or times is None:
            return self.scheduled_steps
        low, full = times
        if self.low_res_until:
            total = total_steps_in_budget(step, left, self.val_seconds(), self.steps_per_epoch, low, full,
                                          self.low_res_until if step < switch else 0.0)
        else:
            total = step + steps_in_budget(left, full, self.val_seconds(), self.steps_per_epoch)
        return min(total, self.scheduled_steps)

    def run_steps(self, step: int, switch: int = 0) -> int:
        """The run's steps: the budget's fitted count once fitted, else the estimate (``fit_steps``)."""
        return self.total_steps if self.total_steps is not None else self.fit_steps(step, switch)

    def remaining_s(self, step: int, switch: int = 0) -> float | None:
        """Seconds left of training and validation, ``step`` done, or None before a step time is known."""
        times = self.step_times()
        if times is None:
            return None
        low, full = times
        steps_left = max(self.run_steps(step, switch) - step, 0)
        low_left = min(max(switch - step, 0), steps_left)
        left = low_left * low + (steps_left - low_left) * full + math.ceil(
            steps_left / self.steps_per_epoch) * self.val_seconds()
        budget = self.budget_left()
        return left if budget is None else min(left, budget)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return {"step_time": self.step_time, "full_step_time": self.full_step_time, "timed_low": self.timed_low,
                "val_time": self.val_time, "total_steps": self.total_steps, "elapsed": self.elapsed(),
                "trained": self.trained_seconds(), "images": self.images_before + self.images}

    def load_state_dict(self, state: dict) -> None:
        self.step_time, self.full_step_time = state["step_time"], state["full_step_time"]
        self.timed_low, self.val_time, self.total_steps = state["timed_low"], state["val_time"], state["total_steps"]
        self.elapsed_before, self.trained_before, self.images_before = (state["elapsed"], state["trained"],
                                                                        state["images"])
