"""What a run will do, said before it does it: ``RunForecast`` prints the model's size, then before the first
training step one line with the device, precision, optimizer, epochs, steps and the estimated wall time of the
whole run (from the step time the probes measured before training; without one, after a few measured steps), and
a hint when the run is far longer than a CPU user expects or its budget is far shorter than its recipe's
schedule; it also gives the progress bar the run's steps (``total_steps``) and remaining time (``remaining_s``).

The estimate is steps left x the step time plus one validation pass per epoch left (measured once one has run;
before that ``guess_val_time``), never more than what is left of a ``--max-time`` budget, plus the test after the
fit; with a budget, the steps are those that fit in it (``steps_in_budget``, the formula ``TimeBudget`` fits the
schedule with, and once it has, its step count). Printed by rank 0 only."""

from __future__ import annotations

import math
import time

import lightning.pytorch as pl

from ..models import model_info
from .device import synchronize

HOUR_S = 3600.0
CPU_BUDGET_HINT = "--config configs/cpu_budget.yaml --max-time 00:00:10:00"


def format_duration(seconds: float) -> str:
    """'41 h 10 min', '9 min 30 s', '45 s'."""
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def guess_val_time(trainer, pl_module, step_time: float) -> float:
    """A validation pass before one was measured: a forward pass costs about a third of a training step, times
    the forward passes test-time augmentation makes (``eval_passes``), times the validation batches."""
    batches = sum(c for c in _as_list(trainer.num_val_batches) if math.isfinite(c))
    return step_time / 3 * getattr(pl_module, "eval_passes", 1) * batches


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


class StepClock:
    """The mean seconds of an optimizer step over the ``measure`` steps that follow the first ``skip`` of a fit
    (those compile and warm caches), the device synchronised at both ends: ``tick`` after each step returns it
    once, at step ``skip + measure``, else None."""

    def __init__(self):
        self._start: float | None = None

    def tick(self, done: int, skip: int, measure: int, device) -> float | None:
        if done == skip:
            synchronize(device)
            self._start = time.perf_counter()
        elif done == skip + measure and self._start is not None:
            synchronize(device)
            return (time.perf_counter() - self._start) / measure
        return None


def long_schedule_settings(recipe) -> list[str]:
    """The recipe's settings that regularise for a schedule of many epochs (they slow learning in a few)."""
    augment, model_args = recipe.augment, recipe.model_args or {}
    found = [name for name, on in (("randaugment", augment.randaugment), ("mixup_alpha", augment.mixup_alpha),
                                   ("cutmix_alpha", augment.cutmix_alpha),
                                   ("drop_path_rate", model_args.get("drop_path_rate"))) if on]
    return found


class RunForecast(pl.Callback):
    """Prints the model line when the fit starts and the plan line before the first training step, from
    ``probe_step_s``, the step time the probes measured before training (``probes.probe_step_seconds``); without
    one (a GPU, several processes) once ``skip_steps + measure_steps`` optimizer steps have run (the first steps
    compile and warm caches, so they are left out of the step time). The measured step time then replaces the
    probe's in the time left the progress bar shows.

    ``budget_s``: the ``--max-time`` budget left for the fit, or None; ``test_images``: the images of the test that
    follows the fit (its estimate is in the plan line's wall time)."""

    def __init__(self, recipe, accelerator: str, machine: str, budget_s: float | None = None,
                 skip_steps: int = 1, measure_steps: int = 3, probe_step_s: float | None = None,
                 test_images: int = 0):
        self.recipe, self.accelerator, self.machine, self.budget_s = recipe, accelerator, machine, budget_s
        self.skip_steps, self.measure_steps = skip_steps, measure_steps
        self.probe_step_s, self.test_images = probe_step_s, test_images
        self.step_time: float | None = None
        self.val_time: float | None = None
        self.lines: list[str] = []  # what it printed, for tests and logs
        self._clock = StepClock()
        self._t_val = self._fit_t0 = None
        self._start_step = 0
        self._measured = False
        self._timed_low = False  # whether step_time is a step on low_res_size images (progressive resizing)

    def _say(self, trainer, line: str) -> None:
        if trainer.is_global_zero:
            bar = trainer.progress_bar_callback
            if getattr(bar, "_train_progress_bar", None) is not None:
                bar.print(line)  # above the progress bar, not inside its line
            else:
                print(line, flush=True)
            self.lines.append(line)

    def on_fit_start(self, trainer, pl_module):
        self._fit_t0 = time.perf_counter()
        info = model_info(pl_module.model)
        _, height, width = info["input_size"]
        self._say(trainer, f"{self.recipe.model}: {info['params'] / 1e6:.2f} M parameters, "
                           f"{info['flops'] / 1e6:,.0f} M FLOPs per {height}x{width} image")

    def on_train_start(self, trainer, pl_module):
        self._start_step = trainer.global_step
        if self.probe_step_s is not None and self.step_time is None:
            self.step_time = self.probe_step_s
            self._announce(trainer, pl_module)
        if self.recipe.compile and self.recipe.compile != "step":  # compile: step says so itself (its cache too)
            self._say(trainer, f"compile: {self.recipe.compile}: the first training steps and the first validation "
                               "compile the model (torch.compile), which takes longer than a step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        done = trainer.global_step - self._start_step
        measured = self._clock.tick(done, self.skip_steps, self.measure_steps, pl_module.device)
        if measured is not None and not self._measured:
            self._measured = True
            announce = self.step_time is None
            self.step_time = measured
            self._timed_low = bool(self.recipe.low_res_size) and trainer.global_step <= getattr(
                pl_module, "low_res_steps", 0)
            if announce:
                self._announce(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module):
        self._t_val = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking and self._t_val is not None:
            self.val_time = time.perf_counter() - self._t_val

    def _val_time(self, trainer, pl_module) -> float:
        if self.val_time is not None:
            return self.val_time
        return guess_val_time(trainer, pl_module, self._step_times()[1])  # validation is at full size

    def _test_time(self, pl_module) -> float:
        """The test after the fit: an image's forward pass costs about a third of its share of a training step, times
        the passes test-time augmentation makes."""
        per_image = self._step_times()[1] / self.recipe.batch_size
        return per_image / 3 * getattr(pl_module, "eval_passes", 1) * self.test_images

    def _time_budget(self, trainer):
        from .callbacks import TimeBudget  # which imports this module

        return next((c for c in trainer.callbacks if isinstance(c, TimeBudget)), None)

    def _budget_left(self, trainer=None) -> float | None:
        if self.budget_s is None:
            return None
        budget = self._time_budget(trainer) if trainer is not None else None
        if budget is not None:  # its clock counts the earlier parts of a resumed run too
            return max(budget.budget_s - budget.elapsed(), 0.0)
        return max(self.budget_s - (time.perf_counter() - self._fit_t0), 0.0)

    def total_steps(self, trainer, pl_module) -> int:
        """The run's optimizer steps: the schedule's, or those that fit in what is left of the budget (once
        ``TimeBudget`` has fitted its schedule, its step count)."""
        scheduled = int(trainer.estimated_stepping_batches)
        budget = self._time_budget(trainer)
        if budget is not None and budget.total_steps is not None:
            return min(scheduled, budget.total_steps)
        left = self._budget_left(trainer)
        if left is None or self.step_time is None:
            return scheduled
        val, per_epoch = self._val_time(trainer, pl_module), _steps_per_epoch(trainer)
        if self.recipe.low_res_size:
            low, full = self._step_times()
            fit = total_steps_in_budget(trainer.global_step, left, val, per_epoch, low, full,
                                        self.recipe.low_res_until)
        else:
            fit = trainer.global_step + steps_in_budget(left, self.step_time, val, per_epoch)
        return min(scheduled, fit)

    def _step_times(self) -> tuple[float, float]:
        """Seconds of a step on low_res_size images and of a full-size one (equal without progressive resizing).
        ``step_time`` is a low-res one where it was measured before the switch, else a full-size one (the probe
        times full-size steps); the other is estimated by the ratio of pixels."""
        size = self.recipe.low_res_size
        cost = (self.recipe.img_size / size) ** 2 if size else 1.0
        return (self.step_time, self.step_time * cost) if self._timed_low else (self.step_time / cost, self.step_time)

    def _switch(self, trainer, pl_module, total: int) -> int:
        """The step where progressive resizing switches to full size (0 without it): the module's, or before
        ``TimeBudget`` has fitted its schedule, the recipe's share of ``total``."""
        if not self.recipe.low_res_size:
            return 0
        budget = self._time_budget(trainer)
        if budget is not None and budget.total_steps is None:
            return int(self.recipe.low_res_until * total)
        return getattr(pl_module, "low_res_steps", 0)

    def remaining_s(self, trainer, pl_module) -> float | None:
        """Seconds left in the whole run (training, validation and the test), or None before a step time is
        known."""
        if self.step_time is None:
            return None
        total = self.total_steps(trainer, pl_module)
        steps_left = max(total - trainer.global_step, 0)
        low_left = min(max(self._switch(trainer, pl_module, total) - trainer.global_step, 0), steps_left)
        low, full = self._step_times()
        left = low_left * low + (steps_left - low_left) * full + math.ceil(
            steps_left / _steps_per_epoch(trainer)) * self._val_time(trainer, pl_module)
        budget_left = self._budget_left(trainer)
        return (left if budget_left is None else min(left, budget_left)) + self._test_time(pl_module)

    def _step_seconds(self) -> str:
        """The plan line's step time: "0.5 s a step", or per size with progressive resizing."""
        if not self.recipe.low_res_size:
            return f"{self.step_time:.3g} s a step"
        (low, full), size, img = self._step_times(), self.recipe.low_res_size, self.recipe.img_size
        return f"{low:.3g} s a step at {size}x{size}, {full:.3g} s at {img}x{img}"

    def _announce(self, trainer, pl_module) -> None:
        recipe, per_epoch = self.recipe, _steps_per_epoch(trainer)
        total = self.total_steps(trainer, pl_module)
        eta = self.remaining_s(trainer, pl_module) + (time.perf_counter() - self._fit_t0)
        if self.budget_s is None:
            schedule = f"{recipe.epochs} epochs x {per_epoch} steps = {total:,} steps"
        else:
            schedule = (f"{total:,} step{'s' if total != 1 else ''} (about {total / per_epoch:.2g} of the recipe's "
                        f"{recipe.epochs} epochs of {per_epoch} steps) in --max-time {recipe.max_time}")
        if trainer.global_step:
            schedule += f", {trainer.global_step:,} done"
        timed = "timed before training" if self.probe_step_s is not None and not self._measured else "measured"
        passes, test_s = getattr(pl_module, "eval_passes", 1), self._test_time(pl_module)
        test = (f"{format_duration(test_s)} the test of {self.test_images:,} images x {passes} "
                f"pass{'es' if passes > 1 else ''}") if self.test_images else "no test"
        self._say(trainer, f"{self.accelerator} ({self.machine}), precision {trainer.precision}, optimizer "
                           f"{recipe.optimizer}, batch {recipe.batch_size}: {schedule}; about {format_duration(eta)} "
                           f"in all ({format_duration(eta - test_s)} training and validation, {test}; "
                           f"{self._step_seconds()}, {timed})")
        regularisers = long_schedule_settings(recipe)
        if self.budget_s is not None and total < 3 * per_epoch and recipe.epochs >= 30 and regularisers:
            self._say(trainer, f"the budget covers {total / per_epoch:.2g} of {recipe.epochs} epochs, and the "
                               f"recipe regularises for all of them ({', '.join(regularisers)}): for a budget of "
                               f"minutes add --config configs/cpu_budget.yaml")
        elif self.accelerator == "cpu" and eta > HOUR_S and self.budget_s is None:
            data = f" --data-dir {recipe.data_dir}" if recipe.data_dir else ""
            self._say(trainer, f"on a CPU that is long: the CPU-sized recipe trains {recipe.model} in 10 minutes: "
                               f"python train.py --model {recipe.model}{data} {CPU_BUDGET_HINT}")


def _steps_per_epoch(trainer) -> int:
    return max(trainer.num_training_batches // trainer.accumulate_grad_batches, 1)


def _as_list(counts) -> list:
    return counts if isinstance(counts, list) else [counts]
