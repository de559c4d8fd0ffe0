"""Peak memory of the attention backends as N grows: chunked is linear in N, math quadratic.

Measure: peak resident set size. One helper process imports torch and zoo once, then forks a fresh child
per case (backend, inference or backward, N); the child builds the module and its inputs, runs a tiny
warm-up (thread pool, kernels), reads ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` as the baseline, runs
the case, and reports the rise of ru_maxrss. A forked child starts with its own high-water mark (at the
parent's current RSS, not the import peak), so one case cannot hide another's peak. The helper runs with
``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB so glibc returns every large freed block to the OS: with its
default, adaptive threshold, freed chunks stay in the heap and fragment, which adds an allocator artefact
(chunked at N=4096: ~108 MiB instead of ~38 MiB) that is not memory the backend keeps alive. Only ratios
are asserted, never absolute sizes or times. B=1, 3 heads, head_dim 64: math's (1, 3, N, N) fp32 scores
are 12.6 MB at N=1024 and 201 MB at N=4096.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_CHILD = r"""
import json, os, resource, sys
import torch
from zoo.layers.attention import MultiHeadAttention

torch.set_num_threads(1)


def measure(backend, backward, n):
    attn = MultiHeadAttention(192, 3, backend=backend, chunk_size=256)
    run = lambda x: attn(x).sum().backward() if backward else attn(x)
    with torch.set_grad_enabled(backward):
        run(torch.randn(1, 8, 192, requires_grad=backward))  # warm-up
        x = torch.randn(1, n, 192, requires_grad=backward)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run(x)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB


results = []
for case in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, str(measure(*case)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        kib = int(pipe.read())
    _, status = os.waitpid(pid, 0)
    assert status == 0, f"case {case} failed with status {status}"
    results.append([*case, kib / 1024])
print(json.dumps(results))
"""


def _peak_mib(cases: list[tuple[str, bool, int]]) -> dict[tuple[str, bool, int], float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return {(backend, backward, n): mib for backend, backward, n, mib in json.loads(proc.stdout)}


SMALL, LARGE = 1024, 4096


@pytest.fixture(scope="module")
def peak() -> dict[tuple[str, bool, int], float]:
    cases = [(backend, backward, n) for backend in ("math", "chunked") for backward in (False, True)
             for n in (SMALL, LARGE)]
    return _peak_mib(cases)


@pytest.mark.parametrize("backward", [False, True], ids=["inference", "backward"])
def test_chunked_memory_linear_math_quadratic(peak, backward):
    math_ratio = peak["math", backward, LARGE] / peak["math", backward, SMALL]
    chunked_ratio = peak["chunked", backward, LARGE] / peak["chunked", backward, SMALL]
    report = f"peak MiB {peak}"
    assert peak["math", backward, LARGE] > 150, report  # the measurement sees the (1, 3, N, N) scores
    assert math_ratio > 8, report
    assert chunked_ratio < 6, report
    assert peak["chunked", backward, LARGE] * 5 < peak["math", backward, LARGE], report
