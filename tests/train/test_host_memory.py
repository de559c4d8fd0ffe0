"""``keep_freed_memory``: the two glibc thresholds it sets (against a recording stand-in for the C library), the
switch and the platforms without glibc, and its effect counted by the kernel: minor page faults of repeated
step-like allocations in a fresh process, with and without it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zoo.runtime import memory as host_memory


class _RecordingLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, parameter, value):
        self.calls.append((parameter, value))
        return 1


def test_sets_the_trim_and_mmap_thresholds(monkeypatch):
    monkeypatch.delenv(host_memory.KEEP_FREED_MEMORY_ENV, raising=False)
    libc = _RecordingLibc()
    assert host_memory.keep_freed_memory(libc)
    assert libc.calls == [(-1, 2**31 - 1), (-3, 32 * 2**20)]  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD in malloc.h


def test_the_switch_and_a_c_library_without_mallopt_leave_malloc_alone(monkeypatch):
    libc = _RecordingLibc()
    monkeypatch.setenv(host_memory.KEEP_FREED_MEMORY_ENV, "0")
    assert not host_memory.keep_freed_memory(libc) and libc.calls == []
    monkeypatch.delenv(host_memory.KEEP_FREED_MEMORY_ENV)
    monkeypatch.setattr(host_memory, "glibc", lambda: None)  # macOS, musl, Windows
    assert not host_memory.keep_freed_memory()


_STEPS = """
import resource, sys, torch
from zoo.runtime.memory import keep_freed_memory
applied = keep_freed_memory()
def step():  # 30 tensors of 1-7 MiB made and freed, as a step's activations and gradients
    kept = [torch.ones((i % 7 + 1) << 18) for i in range(30)]
    del kept
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(host_memory.glibc() is None, reason="glibc's malloc only")
@pytest.mark.slow  # a subprocess that trains; the default suite checks the thresholds set and the switch above
def test_later_steps_reuse_freed_pages_instead_of_faulting_in_new_ones():
    def faults(switch: str) -> tuple[str, int]:
        env = {**os.environ, host_memory.KEEP_FREED_MEMORY_ENV: switch}
        out = subprocess.run([sys.executable, "-c", _STEPS], env=env, capture_output=True, text=True, check=True)
        applied, count = out.stdout.split()
        return applied, int(count)

    (off, without), (on, kept) = faults("0"), faults("1")
    assert (off, on) == ("False", "True")
    # ten steps of ~110 MiB: glibc's defaults fault in most pages afresh (~28k here), kept memory almost none
    assert without > 10_000 and kept < without / 5, (without, kept)
