"""Timing primitives every measurement of the zoo shares: ``synchronize`` (wait for a device's queued work, so a
clock reading means what it says) and ``interleaved_medians`` (candidates timed in turn, repeat after repeat, so a
drift in the machine's speed hits all of them alike)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (CUDA, Apple MPS); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def interleaved_medians(candidates: dict[str, Callable[[], object]], device: torch.device | None = None, *,
                        warmup: int = 1, repeats: int = 5) -> dict[str, float]:
    """Median wall seconds per call of each candidate after ``warmup`` untimed calls. Repeat r runs every
    candidate once before repeat r + 1, so drift in the machine's speed hits all candidates alike."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    device = device or torch.device("cpu")
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
