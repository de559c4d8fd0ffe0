"""Host memory that a training step frees kept for the next step. glibc's malloc hands large freed blocks back to
the system (and serves big requests with fresh mappings), so every step of a CPU run takes its activations and
gradients from new pages and pays a page fault per 4 KiB on first touch: a fifth of a hybrid_tiny step, and as
much as Muon's matmuls in a batched Newton-Schulz step. ``keep_freed_memory`` raises the two thresholds once per
process (the resident size stays at the step's peak instead of falling between steps); PyTorch's CPU tuning guide
reaches the same with jemalloc or tcmalloc preloaded. ``ZOO_KEEP_FREED_MEMORY=0`` leaves malloc as it is."""

from __future__ import annotations

import ctypes
import os

KEEP_FREED_MEMORY_ENV = "ZOO_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 2**31 - 1  # freed memory at the top of the heap stays (mallopt takes an int)
MMAP_THRESHOLD = 32 << 20  # blocks up to 32 MiB come from the heap, reused; glibc's own ceiling for this threshold


def glibc():
    """This process's C library if it is glibc (the one with ``mallopt``'s thresholds), else None (macOS, musl,
    Windows)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def keep_freed_memory(libc=None) -> bool:
    """Keep freed host memory for reuse (see the module); True if malloc's thresholds were set. ``libc``: glibc
    (default: this process's, when it is glibc)."""
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "").strip() == "0":
        return False
    libc = libc or glibc()
    if libc is None:
        return False
    trim = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    mmap = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)  # a fixed one: glibc stops adapting it
    return bool(trim and mmap)
