"""Stopping a run on a signal: SIGTERM (what schedulers and spot instances send before a kill), SIGUSR1 (what SLURM
can be told to send) and SIGINT (Ctrl-C).

During training a signal sets a flag (``StopFlag``) that the loop reads once per step: the step in progress ends,
its rows reach metrics.csv, last.ckpt is written atomically at that step, and the run raises ``Preempted`` (exit
128 + the signal number: 143 for SIGTERM, 130 for Ctrl-C, 138 for SIGUSR1). A second Ctrl-C while the step ends, and
a signal outside training (decoding the data, the probes, the final test: ``stops_at_once``), stop at once with
``Interrupted`` and the same exit codes; the last checkpoint written remains."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from pathlib import Path

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGINT", None),
                            getattr(signal, "SIGUSR1", None)) if s is not None)


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class Preempted(SystemExit):
    """A run stopped by ``signum`` after optimizer step ``step``, its last.ckpt saved at ``checkpoint``. A
    ``SystemExit`` whose ``code`` is 128 + the signal number, the status a shell gives a process the signal ended."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(128 + signum)

    def __str__(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} after step {self.step}; {self.checkpoint} saved: "
                "run the same command with --resume auto to continue")


class Interrupted(SystemExit):
    """A run stopped at once by ``signum`` ``when`` (before training, by a second Ctrl-C, during the final test),
    with no checkpoint written then: ``checkpoint`` (the run's last.ckpt), where it exists when the message is
    read, continues it. A ``SystemExit`` whose ``code`` is 128 + the signal number."""

    def __init__(self, signum: int, when: str, checkpoint: Path | None = None):
        self.signum, self.when, self.checkpoint = signum, when, checkpoint
        super().__init__(128 + signum)

    def __str__(self) -> str:
        name = signal_name(self.signum)
        if self.checkpoint is not None and Path(self.checkpoint).is_file():
            return (f"stopped by {name} {self.when}; {self.checkpoint} remains: run the same command with "
                    "--resume auto to continue")
        return f"stopped by {name} {self.when}; no checkpoint was written, so there is nothing to resume"


@contextlib.contextmanager
def _handlers(handle: Callable[[int, object], None]):
    """``handle`` for SIGTERM, SIGUSR1 and SIGINT inside the block (outside the main thread the handlers stay as
    they are); the previous handlers come back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handle) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def stops_at_once(when: str, checkpoint: Path | None = None):
    """Inside the block a signal raises ``Interrupted(signum, when, checkpoint)``."""
    def handle(signum, frame):
        raise Interrupted(signum, when, checkpoint)

    with _handlers(handle):
        yield


class StopFlag:
    """The signal that asks a run to stop at the end of its step: ``installed()`` sets the handlers for training,
    ``signum`` is the first signal received (None before one). A second Ctrl-C raises ``Interrupted`` at once; a
    repeated SIGTERM or SIGUSR1 is ignored. ``forward`` (called with the signal number) passes it on, to processes
    this one started."""

    def __init__(self, checkpoint: Path, forward: Callable[[int], None] | None = None):
        self.checkpoint, self.forward = checkpoint, forward
        self.signum: int | None = None

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:  # Ctrl-C twice: stop now
                raise Interrupted(signum, "a second time, before the step ended", self.checkpoint)
            return
        self.signum = signum
        if self.forward is not None:
            self.forward(signum)

    @contextlib.contextmanager
    def installed(self):
        with _handlers(self._handle):
            yield self
