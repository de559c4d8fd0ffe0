"""Stopping a run on a signal and continuing it exactly.

``PreemptionCheckpoint``: on SIGTERM (what schedulers and spot instances send before a kill), SIGUSR1 (what SLURM
can be told to send) or SIGINT (Ctrl-C) during training, the run finishes the optimizer step in progress (a signal
on an epoch's last step, or during its validation, waits for the end of that validation), writes
``checkpoints/last.ckpt`` atomically at that step and raises ``Preempted`` once the step's (or the epoch's) rows are
logged to metrics.csv: no summary.json is written, and the command exits with 128 + the signal number (143 for
SIGTERM, 130 for SIGINT). A second Ctrl-C while it waits, and a signal outside training (decoding the data, the
final test: ``stops_at_once``), stop at once with ``Interrupted``, the same exit codes (the last checkpoint
written remains).

``RandomStates`` and ``EpochOrder`` put what the rest of a run depends on into every checkpoint: the global random
generators (torch CPU and CUDA, Python, NumPy: augmentation, dropout) and the data order (the shuffle generator's
state when the epoch's permutation was drawn, and the batches of it already trained on), so a run resumed from
any last.ckpt draws the same batches and augmentations as the uninterrupted run. ``EpochMetrics`` puts the training
epoch's metrics so far (torchmetrics states, Lightning's running means) into a checkpoint taken inside an epoch, so
the resumed epoch's row in metrics.csv counts every batch of it, as the uninterrupted run's does."""

from __future__ import annotations

import contextlib
import random
import signal
import threading
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torchmetrics import Metric

from .callbacks import decides_now

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGINT", None),
                            getattr(signal, "SIGUSR1", None)) if s is not None)


class Preempted(SIGTERMException):
    """A run stopped by ``signum`` after optimizer step ``step``, its last.ckpt saved at ``checkpoint``. A
    ``SystemExit`` (as Lightning's ``SIGTERMException``, which callbacks' ``on_exception`` may look for) whose
    ``code`` is 128 + the signal number, the status a shell gives a process the signal ended."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(128 + signum)

    def __str__(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} after step {self.step}; {self.checkpoint} saved: "
                "run the same command with --resume auto to continue")


class Interrupted(SIGTERMException):
    """A run stopped at once by ``signum`` ``when`` (before training, by a second Ctrl-C, during the final test),
    with no checkpoint written then: ``checkpoint`` (the run's last.ckpt), where it exists when the message is
    read, continues it. A ``SystemExit`` whose ``code`` is 128 + the signal number, and not a KeyboardInterrupt,
    which Lightning would turn into exit code 1."""

    def __init__(self, signum: int, when: str, checkpoint: Path | None = None):
        self.signum, self.when, self.checkpoint = signum, when, checkpoint
        super().__init__(128 + signum)

    def __str__(self) -> str:
        name = "Ctrl-C" if self.signum == signal.SIGINT else signal.Signals(self.signum).name
        if self.checkpoint is not None and Path(self.checkpoint).is_file():
            return (f"stopped by {name} {self.when}; {self.checkpoint} remains: run the same command with "
                    "--resume auto to continue")
        return f"stopped by {name} {self.when}; no checkpoint was written, so there is nothing to resume"


@contextlib.contextmanager
def stops_at_once(when: str, checkpoint: Path | None = None):
    """SIGTERM, SIGUSR1 and SIGINT raise ``Interrupted(signum, when, checkpoint)`` inside the block (outside the
    main thread the handlers stay as they are); the previous handlers come back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, frame):
        raise Interrupted(signum, when, checkpoint)

    previous = {signum: signal.signal(signum, handle) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


class PreemptionCheckpoint(Checkpoint):
    """Saves ``path`` (the run's last.ckpt) at the end of the optimizer step in progress when SIGTERM, SIGUSR1 or
    SIGINT arrives during training, then raises ``Preempted``. Its handlers replace Lightning's for the fit's
    training (Lightning's SIGTERM handler would stop without a checkpoint, in the middle of a validation) and
    the previous handlers come back when the fit ends. Under several processes a rank that was signalled stops
    every rank at the same step: one all-reduce of a flag every ``decide_every`` steps (a host sync on a GPU) and
    at each epoch's end. A ``Checkpoint``, so Lightning runs it after the other callbacks: the saved step includes
    their updates (the EMA of the weights). ``Preempted`` is raised at the next batch's or epoch's start (or the
    training's end), after Lightning has logged the stopped step's or epoch's metrics, which would be lost if it
    were raised at once: the checkpoint is past them and the resumed run does not log them again."""

    def __init__(self, path: Path, decide_every: int = 1):
        self.path, self.decide_every = Path(path), decide_every
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._trainer: pl.Trainer | None = None
        self._stopped: Preempted | None = None

    def on_train_start(self, trainer, pl_module):
        self._trainer = trainer
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:  # Ctrl-C twice: stop now
                raise Interrupted(signum, "a second time, before the step ended", self.path)
            return
        self.signum = signum
        launcher = getattr(self._trainer.strategy, "launcher", None) if self._trainer is not None else None
        if launcher is not None and getattr(launcher, "procs", None):  # DDP processes this one started
            launcher.kill(signum)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # on an epoch's last step the epoch's validation runs first: a checkpoint taken between them would resume
        # into a skipped validation
        if not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and decides_now(trainer, self.decide_every):
            self._maybe_stop(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self._maybe_stop(trainer)

    def _maybe_stop(self, trainer: pl.Trainer) -> None:
        stop = self.signum is not None
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop or self._stopped is not None:
            return
        trainer.save_checkpoint(self.path)
        self._restore()
        self._stopped = Preempted(self.signum or signal.SIGTERM, trainer.global_step, self.path)

    def _raise_stopped(self) -> None:
        if self._stopped is not None:
            stopped, self._stopped = self._stopped, None
            raise stopped

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._raise_stopped()

    def on_train_epoch_start(self, trainer, pl_module):
        self._raise_stopped()

    def on_train_end(self, trainer, pl_module):
        self._raise_stopped()

    def on_exception(self, trainer, pl_module, exception):
        self._stopped = None
        self._restore()

    def teardown(self, trainer, pl_module, stage):
        self._restore()


class RandomStates(pl.Callback):
    """The global random generators in every checkpoint, set again when a run resumes from one: torch's CPU
    generator and the current GPU's or Apple GPU's (augmentation and dropout draw from them), Python's and
    NumPy's. Stored as tensors and plain Python values, which ``torch.load(weights_only=True)`` reads."""

    def state_dict(self) -> dict:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state = {"torch": torch.get_rng_state(), "python": random.getstate(),
                 "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                           "has_gauss": int(has_gauss), "gauss": float(gauss)}}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # this process's own GPU: only rank 0 writes the checkpoint, and in its process the other GPUs'
            # generators are seeded but never drawn from; every rank's generators stay equal to rank 0's (one
            # seed; the augmentation draws for the whole global batch on every rank and each takes its slice)
            state["cuda"] = torch.cuda.get_rng_state()
        if torch.backends.mps.is_available():
            state["mps"] = torch.mps.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
        if "cuda" in state and torch.cuda.is_available():
            cuda = state["cuda"]  # a list, one state per GPU, in checkpoints written before: the first was used
            torch.cuda.set_rng_state(cuda[0] if isinstance(cuda, (list, tuple)) else cuda)
        if "mps" in state and torch.backends.mps.is_available():
            torch.mps.set_rng_state(state["mps"])


class EpochMetrics(pl.Callback):
    """The training epoch's metrics so far in a checkpoint taken inside an epoch, added back when a run resumes from
    it: every torchmetrics ``Metric`` of the LightningModule (top-1 / top-5: their states and update counts, set back
    at load) and the running means Lightning keeps of the values logged with ``on_epoch=True`` (``train/loss``:
    weighted sum and batch count, added to the first resumed batch's, which is the sum the uninterrupted run makes
    in another order of two terms: the same float). One process only: under DDP each rank holds its own part of
    the epoch and the checkpoint has rank 0's (a resumed epoch's row then counts the batches after the resume)."""

    def __init__(self):
        self._means: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if not trainer.training or trainer.world_size > 1 or not 0 < done < trainer.num_training_batches:
            return  # an epoch's end (the next epoch starts afresh), or nothing of this epoch yet
        metrics = {name: {"state": {key: value.detach().clone() for key, value in m.metric_state.items()
                                    if isinstance(value, torch.Tensor)}, "updates": int(m._update_count)}
                   for name, m in pl_module.named_modules() if isinstance(m, Metric)}
        results = trainer.fit_loop.epoch_loop._results
        means = {key: (r.value.detach().clone(), r.cumulated_batch_size.detach().clone())
                 for key, r in results.items() if r.is_tensor and r.meta.on_epoch and r.meta.is_mean_reduction}
        checkpoint["epoch_metrics"] = {"metrics": metrics, "means": means}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        saved = checkpoint.get("epoch_metrics")
        if not saved or trainer.world_size > 1:
            return
        modules = dict(pl_module.named_modules())
        for name, entry in saved["metrics"].items():
            metric = modules.get(name)
            if not isinstance(metric, Metric):
                continue
            for key, value in entry["state"].items():
                setattr(metric, key, value.to(getattr(metric, key).device))
            metric._update_count, metric._computed = entry["updates"], None
        self._means = dict(saved["means"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self._means:
            return
        results = trainer.fit_loop.epoch_loop._results
        for key, (value, count) in self._means.items():
            if key in results:
                result = results[key]
                result.value = result.value + value.to(result.value)
                result.cumulated_batch_size = result.cumulated_batch_size + count.to(result.cumulated_batch_size)
        self._means = {}


class EpochOrder:
    """Where the training data order stands: the shuffle ``generator``'s state when the current epoch's loader
    iterator was created (everything the epoch draws from it follows from that state) and, after a resume, the
    global batches of that epoch already trained on, which the sampler skips once."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.epoch_state: torch.Tensor | None = None
        self._resume: tuple[torch.Tensor, int] | None = None
        self._skip = 0

    def start_epoch(self) -> None:
        """Called as the training loader's iterator is created, before anything is drawn for the epoch."""
        if self._resume is not None:
            state, self._skip = self._resume
            self.generator.set_state(state)
            self._resume = None
        self.epoch_state = self.generator.get_state()

    def take_skip(self) -> int:
        """Global batches of this epoch to leave out (once, after a resume), for the sampler."""
        skip, self._skip = self._skip, 0
        return skip

    def state_dict(self, batches_done: int, epoch_done: bool) -> dict:
        if epoch_done or self.epoch_state is None:  # the next epoch starts from the generator as it is now
            return {"generator": self.generator.get_state(), "skip": 0}
        return {"generator": self.epoch_state, "skip": int(batches_done)}

    def load_state_dict(self, state: dict) -> None:
        self._resume = (state["generator"], int(state["skip"]))
