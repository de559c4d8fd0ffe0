"""Stopping a run on a signal and continuing it exactly.

``PreemptionCheckpoint``: on SIGTERM (what schedulers and spot instances send before a kill), SIGUSR1 (what SLURM
can be told to send) or SIGINT (Ctrl-C) during training, the run finishes the optimizer step in progress (a signal
on an epoch's last step, or during its validation, waits for the end of that validation), writes
``checkpoints/last.ckpt`` atomically at that step and raises ``Preempted``: no summary.json is written, and the
command exits with 128 + the signal number (143 for SIGTERM, 130 for SIGINT). A second Ctrl-C while it waits
stops at once (the last interval checkpoint remains). Outside training (decoding the data, the final test)
signals keep their usual effect.

``RandomStates`` and ``EpochOrder`` put what the rest of a run depends on into every checkpoint: the global random
generators (torch CPU and CUDA, Python, NumPy: augmentation, dropout) and the data order (the shuffle generator's
state when the epoch's permutation was drawn, and the batches of it already trained on), so a run resumed from
any last.ckpt draws the same batches and augmentations as the uninterrupted run."""

from __future__ import annotations

import random
import signal
import threading
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

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


class PreemptionCheckpoint(Checkpoint):
    """Saves ``path`` (the run's last.ckpt) at the end of the optimizer step in progress when SIGTERM, SIGUSR1 or
    SIGINT arrives during training, then raises ``Preempted``. Its handlers replace Lightning's for the fit's
    training (Lightning's SIGTERM handler would stop without a checkpoint, in the middle of a validation) and
    the previous handlers come back when the fit ends. Under several processes a rank that was signalled stops
    every rank at the same step: one all-reduce of a flag every ``decide_every`` steps (a host sync on a GPU) and
    at each epoch's end. A ``Checkpoint``, so Lightning runs it after the other callbacks: the saved step includes
    their updates (the EMA of the weights)."""

    def __init__(self, path: Path, decide_every: int = 1):
        self.path, self.decide_every = Path(path), decide_every
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._trainer: pl.Trainer | None = None

    def on_train_start(self, trainer, pl_module):
        self._trainer = trainer
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:  # Ctrl-C twice: stop now
                raise KeyboardInterrupt
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
        if not stop:
            return
        trainer.save_checkpoint(self.path)
        self._restore()
        raise Preempted(self.signum or signal.SIGTERM, trainer.global_step, self.path)

    def on_exception(self, trainer, pl_module, exception):
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
