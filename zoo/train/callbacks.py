"""Training callbacks: ``TimeBudget`` fits the step count and the learning-rate schedule to a wall-clock
budget (``--max-time``); ``Throughput`` measures training images per second, validation excluded;
``ValidationClock`` logs the fit's wall time beside each validation's scores (time to an accuracy);
``EMAWeightAveraging`` keeps an exponential moving average of the weights and ``LossProgressBar`` shows the
training loss, neither of them reading a device value on the host between progress-bar refreshes;
``LastCheckpoint`` writes last.ckpt every N steps and when training ends; ``TimedCheckpoint`` and ``StepTimer`` are
Lightning's time-interval checkpoint and time limit, deciding every few steps under several processes
(``decides_now``)."""

from __future__ import annotations

import sys
import time
from itertools import chain

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, Timer, TQDMProgressBar, WeightAveraging
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, _update_n, convert_inf

from .compiled import CompiledStep
from .device import synchronize
from .forecast import RunForecast, StepClock, format_duration, guess_val_time, steps_in_budget, total_steps_in_budget
from .optim import ema_multi_avg_fn


class TimeBudget(pl.Callback):
    """Fits the LR schedule to a wall-clock budget for the fit (training and validation, as Lightning's
    ``max_time``; the final test runs after it) and stops training when the budget is spent.

    After ``measure_steps`` optimizer steps it measures the step time, estimates how many steps fit in what
    is left of ``budget_s`` once validation (one pass per epoch, test-time augmentation included) is paid for,
    and re-fits warm-up + decay to that; it re-fits after every validation with the measured validation time,
    and every ``REFIT_EVERY`` steps with the step time of those steps (validation left out, checkpoint writes
    in), so a machine that was busy while the first steps were timed, or gets busy later, still ends inside the
    budget and near its end; it stops training when the fitted step count is reached. Its state travels in
    checkpoints.

    With progressive resizing (the module's ``low_res_steps`` > 0: steps before it train on smaller images) the
    fit counts the steps after the switch at the full-size step time: ``low_res_cost`` times the measured one
    until ``FULL_MEASURE`` full-size steps after the switch (the first ``FULL_SKIP`` compile) have measured it,
    then the fit is made again (``forecast.total_steps_in_budget``).

    Under several processes rank 0's clock decides: the measured times and the fitted step count are broadcast
    (``trainer.strategy.broadcast``, at steps every rank reaches together), so all ranks refit the same schedule
    and stop on the same global step."""

    FULL_SKIP, FULL_MEASURE = 3, 10
    REFIT_EVERY = 50

    def __init__(self, budget_s: float, measure_steps: int = 20, skip_steps: int = 5):
        self.budget_s, self.measure_steps, self.skip_steps = budget_s, measure_steps, skip_steps
        self.step_time: float | None = None  # the first measured step time (at the small size when resizing)
        self.full_step_time: float | None = None  # with progressive resizing: measured after the switch
        self.val_time: float | None = None
        self.total_steps: int | None = None
        self.elapsed_before = 0.0  # budget spent by earlier (killed) parts of a resumed run
        self._clock, self._full_clock = StepClock(), StepClock()
        self._t0 = self._val_t = None
        self._val_spent = 0.0  # validation seconds of this process, kept out of the step-time windows
        self._window: tuple[int, float, float] | None = None  # (step, clock, _val_spent) where the window began

    def state_dict(self) -> dict:
        return {"step_time": self.step_time, "full_step_time": self.full_step_time, "val_time": self.val_time,
                "total_steps": self.total_steps, "elapsed": self.elapsed()}

    def load_state_dict(self, state: dict) -> None:
        self.step_time, self.val_time = state["step_time"], state["val_time"]
        self.full_step_time = state.get("full_step_time")  # absent in checkpoints written before resizing
        self.total_steps = state["total_steps"]
        self.elapsed_before = state["elapsed"]

    def elapsed(self) -> float:
        return self.elapsed_before + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    def on_train_start(self, trainer, pl_module):
        self._t0 = time.perf_counter()
        self._start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        done = trainer.global_step - self._start_step
        measured = self._clock.tick(done, self.skip_steps, self.measure_steps, pl_module.device)
        switch = getattr(pl_module, "low_res_steps", 0)
        if measured is not None and self.step_time is None:
            self.step_time = trainer.strategy.broadcast(measured)  # rank 0's clock decides
            if switch and self._start_step + self.skip_steps >= switch:  # measured on full-size steps alone
                self.full_step_time = self.step_time
            self._refit(trainer, pl_module)
        if switch and self.step_time is not None and self.full_step_time is None and trainer.global_step > switch:
            measured = self._full_clock.tick(trainer.global_step - switch, self.FULL_SKIP, self.FULL_MEASURE,
                                             pl_module.device)
            if measured is not None:
                self.full_step_time = trainer.strategy.broadcast(measured)
                self._refit(trainer, pl_module)
        if self.step_time is not None:
            self._window_tick(trainer, pl_module, switch)
        if self.total_steps is not None and trainer.global_step >= self.total_steps:
            trainer.should_stop = True

    def _window_tick(self, trainer, pl_module, switch: int) -> None:
        """Every ``REFIT_EVERY`` steps: the mean step time of those steps replaces the step time of their phase
        (all before the switch, or all full-size ones after the compiling ones), and the schedule is refitted; a
        window across the switch is dropped."""
        step = trainer.global_step
        if step - self._start_step < self.skip_steps or (  # a resumed process compiles again first
                self._window is not None and step - self._window[0] < self.REFIT_EVERY):
            return
        synchronize(pl_module.device)
        now = time.perf_counter()
        window, self._window = self._window, (step, now, self._val_spent)
        if window is None:
            return
        start, began, val_before = window
        seconds = trainer.strategy.broadcast((now - began - (self._val_spent - val_before)) / (step - start))
        if not switch or step <= switch:
            self.step_time = seconds
        elif start >= switch + self.FULL_SKIP:
            self.full_step_time = seconds
        else:
            return
        self._refit(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module):
        self._val_t = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or self._val_t is None:
            return
        self._val_spent += time.perf_counter() - self._val_t
        self.val_time = trainer.strategy.broadcast(time.perf_counter() - self._val_t)
        if self.step_time is not None:
            self._refit(trainer, pl_module)

    def _refit(self, trainer, pl_module) -> None:
        steps_per_epoch = max(trainer.num_training_batches // trainer.accumulate_grad_batches, 1)
        left, done = self.budget_s - self.elapsed(), trainer.global_step
        switch = getattr(pl_module, "low_res_steps", 0)
        full = (self.full_step_time or self.step_time * pl_module.low_res_cost) if switch else self.step_time
        # before validation was measured (at full size): a forward pass costs about a third of a training step,
        # times the forward passes test-time augmentation makes
        val_time = self.val_time if self.val_time is not None else guess_val_time(trainer, pl_module, full)
        if switch:
            total = total_steps_in_budget(done, left, val_time, steps_per_epoch, self.step_time, full,
                                          pl_module.hparams.low_res_until if done < switch else 0.0)
        else:
            total = done + steps_in_budget(left, self.step_time, val_time, steps_per_epoch)
        self.total_steps = trainer.strategy.broadcast(total)  # rank 0's clock decides
        pl_module.refit_schedule(self.total_steps)


class Throughput(pl.Callback):
    """Training images per second over the whole fit, validation and checkpoint writes excluded: ``writes`` is the
    run's ``AtomicCheckpointIO``, whose write seconds while the clock ran are taken off. ``later_images_per_s``:
    the same over the epochs after the first one this process trained (which pays for compilation and warm-up)."""

    def __init__(self, writes=None):
        self.images = 0
        self.train_s = 0.0
        self.writes = writes
        self._t = self._written = None
        self._first = None  # (images, seconds) once the first epoch has ended

    @property
    def later_images_per_s(self) -> float | None:
        if self._first is None or self.train_s <= self._first[1]:
            return None
        return (self.images - self._first[0]) / (self.train_s - self._first[1])

    def _start(self) -> None:
        self._t = time.perf_counter()
        self._written = self.writes.write_seconds if self.writes is not None else 0.0

    def on_train_epoch_start(self, trainer, pl_module):
        self._start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.images += batch[0].shape[0] * trainer.world_size

    def on_validation_start(self, trainer, pl_module):
        self._pause(pl_module.device)

    def on_validation_end(self, trainer, pl_module):
        self._start()

    def on_train_epoch_end(self, trainer, pl_module):
        self._pause(pl_module.device)
        if self._first is None:
            self._first = (self.images, self.train_s)

    def _pause(self, device: torch.device):
        if self._t is not None:
            synchronize(device)
            written = (self.writes.write_seconds if self.writes is not None else 0.0) - self._written
            self.train_s += time.perf_counter() - self._t - written
            self._t = None

    @property
    def images_per_s(self) -> float:
        return self.images / self.train_s if self.train_s > 0 else 0.0


class ValidationClock(pl.Callback):
    """Logs ``time/elapsed_s``, the wall seconds since the fit started (validation included, a resumed run's
    earlier parts not), with each validation's scores: metrics.csv then says when a run first reached an accuracy."""

    def __init__(self):
        self._t0 = None

    def on_train_start(self, trainer, pl_module):
        self._t0 = time.perf_counter()

    def on_validation_epoch_end(self, trainer, pl_module):
        if self._t0 is not None and not trainer.sanity_checking:
            pl_module.log("time/elapsed_s", time.perf_counter() - self._t0, on_epoch=True)


class EMAWeightAveraging(WeightAveraging):
    """Lightning's ``WeightAveraging`` (validation, checkpoints and the test see the average) with the EMA of
    ``optim.ema_multi_avg_fn`` after every optimizer step, over parameters and buffers. The update never syncs:
    ``AveragedModel.update_parameters`` would read its count on the host twice per update (``bool(n == 0)``),
    so the callback runs the foreach average itself, the count staying on the device. Under ``compile: step``
    the update joins the compiled optimizer step (``compiled.CompiledStep.after_step``)."""

    def __init__(self, decay: float):
        self._average_fn = ema_multi_avg_fn(decay)
        super().__init__(use_buffers=True, multi_avg_fn=self._average_fn)
        self._in_step = False

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self._in_step = isinstance(optimizer, CompiledStep)
        if self._in_step:
            optimizer.after_step.append(self._updater(pl_module))

    def _updater(self, pl_module):
        """The update as a function of no argument over the tensors it averages (gathered once; not detached: a
        detached alias of a parameter beside the parameter itself would make a compiled step copy every
        parameter in and out)."""
        average = self._average_model
        pairs = zip(chain(average.module.parameters(), average.module.buffers()),
                    chain(pl_module.parameters(), pl_module.buffers()), strict=True)
        groups: dict[torch.dtype, tuple[list, list]] = {}
        copied: list[tuple[torch.Tensor, torch.Tensor]] = []
        for averaged, current in pairs:
            if averaged.is_floating_point():
                lists = groups.setdefault(averaged.dtype, ([], []))
                lists[0].append(averaged)
                lists[1].append(current)
            else:  # integer buffers (counters, flags) follow the model, as AveragedModel copies them
                copied.append((averaged, current))

        @torch.no_grad()
        def update():
            for averaged, current in copied:
                averaged.copy_(current)
            for averaged, current in groups.values():
                self._average_fn(averaged, current, average.n_averaged)
            average.n_averaged.add_(1)
        return update

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step_idx = trainer.global_step - 1  # as WeightAveraging: updates once per optimizer step
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            if not self._in_step:  # the compiled step updated already
                self._updater(pl_module)()
            self._latest_update_step = trainer.global_step


class LossProgressBar(TQDMProgressBar):
    """Lightning's progress bar over the whole run rather than an epoch: its total is the run's optimizer steps
    (``run_steps``: the schedule's, or those a ``--max-time`` budget buys) and its count the global step, so a
    resumed run's bar starts where the run stands, with its total; the epoch is in its description. Each bar is
    printed first with its total (Lightning's prints ``0/?`` and redraws it when the total is known). The latest
    training loss is read only when the bar refreshes: the module logs the loss without ``prog_bar`` (Lightning
    turns progress-bar values into Python numbers after every batch, one host sync per step), and this bar reads it
    from the callback metrics at its own refresh rate. With a ``RunForecast`` among the callbacks it shows the whole
    run's time left ("run left", validation and test included) in place of tqdm's estimate of training steps."""

    TRAIN_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed}, {rate_noinv_fmt}{postfix}]"

    def run_steps(self, trainer) -> int:
        """The run's optimizer steps: the schedule's (``estimated_stepping_batches``), or fewer where a time budget
        stops it earlier (``RunForecast.total_steps``)."""
        forecast = _forecast(trainer)
        if forecast is not None:
            return forecast.total_steps(trainer, trainer.lightning_module)
        return int(trainer.estimated_stepping_batches)

    def _bar(self, desc: str, total, position: int, leave: bool, bar_format: str, **kwargs) -> Tqdm:
        return Tqdm(desc=desc, total=convert_inf(total), position=2 * self.process_position + position,
                    disable=self.is_disabled, leave=leave, dynamic_ncols=True, file=sys.stdout,
                    bar_format=bar_format, **kwargs)

    def on_train_start(self, trainer, pl_module):
        self.train_progress_bar = self._bar(f"Epoch {trainer.current_epoch}", self.run_steps(trainer), 0, True,
                                            self.TRAIN_BAR_FORMAT, smoothing=0, initial=trainer.global_step)
        self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)

    def on_train_epoch_start(self, trainer, *_):
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}", refresh=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = self.train_progress_bar
        if bar is not None and self._should_update(batch_idx + 1, self.total_train_batches):
            bar.total = self.run_steps(trainer)  # a budget's steps are known better as the run goes
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            _update_n(bar, trainer.global_step)

    def on_validation_start(self, trainer, pl_module):  # during the fit: below the training bar
        if not trainer.sanity_checking:
            self.val_progress_bar = self._bar(self.validation_description, trainer.num_val_batches[0], 1, False,
                                              self.BAR_FORMAT)

    def on_test_start(self, trainer, pl_module):
        self.test_progress_bar = self._bar(self.test_description, trainer.num_test_batches[0], 0, True,
                                           self.BAR_FORMAT)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.has_dataloader_changed(dataloader_idx):  # as Lightning's, without drawing the bar again
            self.val_progress_bar.total = convert_inf(self.total_val_batches_current_dataloader)
            self.val_progress_bar.set_description(f"{self.validation_description} DataLoader {dataloader_idx}",
                                                  refresh=False)

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.has_dataloader_changed(dataloader_idx):
            self.test_progress_bar.total = convert_inf(self.total_test_batches_current_dataloader)
            self.test_progress_bar.set_description(f"{self.test_description} DataLoader {dataloader_idx}",
                                                   refresh=False)

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the run directory's id, printed when the run ends
        loss = trainer.callback_metrics.get("train/loss_step")
        if trainer.training and loss is not None:
            metrics["train/loss"] = f"{loss.item():.3g}"
        forecast = _forecast(trainer)
        left = forecast.remaining_s(trainer, pl_module) if forecast is not None and trainer.training else None
        if left is not None:  # the whole run's time left
            metrics["run left"] = format_duration(left)
        return metrics


def _forecast(trainer) -> RunForecast | None:
    return next((c for c in trainer.callbacks if isinstance(c, RunForecast)), None)


def decides_now(trainer: pl.Trainer, every: int) -> bool:
    """Whether this step makes the decisions all ranks share (rank 0's clock or a signal, broadcast or reduced):
    every step in one process, where they need no collective; every ``every``-th optimizer step under several,
    a step all ranks reach together."""
    return trainer.world_size == 1 or trainer.global_step % every == 0


class _DecidesEveryFewSteps:
    """Runs the base callback's batch-end check (rank 0's clock, broadcast to every rank) on ``decides_now`` steps
    only; the subclass sets ``decide_every``."""

    decide_every = 1

    def on_train_batch_end(self, trainer, *args, **kwargs):
        if decides_now(trainer, self.decide_every):
            super().on_train_batch_end(trainer, *args, **kwargs)


class LastCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint(save_last=True)`` that writes last.ckpt when training ends unless a checkpoint
    callback of the same file name wrote it at this step. Lightning's writes it at the end only if this callback
    never wrote it, so a run that saved every N steps would end with a last.ckpt from before its final steps."""

    def on_train_end(self, trainer, pl_module):
        written = {cb._last_global_step_saved for cb in trainer.checkpoint_callbacks
                   if isinstance(cb, ModelCheckpoint) and cb.filename == self.filename}
        if self.save_last and trainer.global_step not in written:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class TimedCheckpoint(_DecidesEveryFewSteps, ModelCheckpoint):
    """Lightning's ``ModelCheckpoint(train_time_interval=...)``, whose time check runs on ``decides_now`` steps
    only."""

    def __init__(self, *args, decide_every: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.decide_every = decide_every


class StepTimer(_DecidesEveryFewSteps, Timer):
    """Lightning's ``Timer`` as ``Trainer(max_time=...)`` adds it, whose check runs on ``decides_now`` steps only;
    its checkpoint state keeps ``Timer``'s key, so a run written before resumes its elapsed time."""

    def __init__(self, duration, decide_every: int = 1):
        super().__init__(duration=duration, interval="step")
        self.decide_every = decide_every

    @property
    def state_key(self) -> str:
        return Timer.__qualname__
