"""Progress of eval.py's long passes (testing, test-time augmentation, explaining, perturbing): a bar on a terminal,
and where stderr is a pipe or a file (``| tee``, nohup, a job log), where a bar is one ever-growing line, a line at
each tenth of the pass, so a pass of minutes is never silent. On stderr: standard output holds the results."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

Item = TypeVar("Item")
STEPS = 10  # lines per pass where stderr is not a terminal


class Progress:
    """A count of ``total`` ``unit`` as work is done (``update(n)``): a tqdm bar on a terminal, else ``desc:
    done/total unit`` lines on stderr at each tenth of ``total`` (the last at the end). ``enabled`` False: silent
    (another rank, a caller that asked for quiet)."""

    def __init__(self, *, total: int, desc: str, unit: str, enabled: bool = True):
        self.total, self.desc, self.unit, self.done = total, desc, unit, 0
        terminal = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr) if terminal else None
        self.lines = enabled and not terminal

    def update(self, n: int = 1) -> None:
        before, self.done = self.done, self.done + n
        if self.bar is not None:
            self.bar.update(n)
        whole = max(self.total, 1)
        if self.lines and STEPS * self.done // whole > STEPS * before // whole:  # a tenth passed, or the end
            print(f"{self.desc}: {self.done:,}/{self.total:,} {self.unit}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def counted(items: Iterable[Item], *, total: int, desc: str, unit: str,
            size: Callable[[Item], int] = lambda item: 1, enabled: bool = True) -> Iterator[Item]:
    """Yield ``items``, counting ``size(item)`` of them done as each is (``Progress``)."""
    progress = Progress(total=total, desc=desc, unit=unit, enabled=enabled)
    try:
        for item in items:
            yield item
            progress.update(size(item))
    finally:
        progress.close()
