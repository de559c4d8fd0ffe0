"""zoo.bench.timing without trusting the machine's speed: the clock is replaced by a scripted one, so medians,
images/s and latency are checked against numbers worked by hand; what is not a timing (the model's weights and
mode left alone, peak memory of a known allocation, argument checks) is checked as it is."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from zoo import bench
from zoo.runtime import timing as timing_module


class FakeClock:
    """Stands in for the ``time`` module inside zoo.bench.timing: time moves only when ``advance`` is called."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing_module, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def test_interleaved_medians_are_medians_of_the_timed_calls_in_interleaved_order(clock):
    durations = {"a": iter([50.0, 50.0, 3.0, 1.0, 2.0]), "b": iter([70.0, 70.0, 9.0, 5.0, 7.0])}
    order = []

    def candidate(name):
        def call():
            order.append(name)
            clock.advance(next(durations[name]))
        return call

    medians = bench.interleaved_medians({"a": candidate("a"), "b": candidate("b")}, warmup=2, repeats=3)
    assert medians == {"a": 2.0, "b": 7.0}  # the warm-up calls (50, 70) are not timed
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3
    calls = []
    assert bench.median_seconds(lambda: calls.append(clock.advance(0.25)), torch.device("cpu"), warmup=1,
                                repeats=4) == 0.25
    assert len(calls) == 5


class SlowLinear(nn.Module):
    """A linear classifier whose forward takes ``seconds`` on the fake clock and records its mode."""

    def __init__(self, clock: FakeClock, seconds: float):
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 10)
        self.tick = lambda: clock.advance(seconds)  # deepcopy shares functions: a copy ticks the same clock
        self.modes = []

    def forward(self, x):
        self.tick()
        self.modes.append(self.training)
        return self.fc(x.flatten(1))


def test_images_per_second_and_latency_from_the_clock(clock):
    model = SlowLinear(clock, seconds=0.5)
    assert bench.measure_inference(model, (3, 8, 8), 4, repeats=3) == 8.0  # 4 images per 0.5 s
    assert bench.measure_latency(model, (3, 8, 8), repeats=3) == 0.5  # one batch-1 forward
    assert bench.measure_training(model, (3, 8, 8), 4, repeats=3) == 8.0  # backward and step take no time


def test_measuring_leaves_the_model_as_it_was(clock):
    model = SlowLinear(clock, seconds=0.1).train()
    before = [p.clone() for p in model.parameters()]
    bench.measure_inference(model, (3, 8, 8), 4, repeats=2)
    assert model.training and set(model.modes) == {False}  # measured in eval mode, then put back
    model.eval()
    bench.measure_training(model, (3, 8, 8), 4, repeats=2)  # trains a copy
    assert not model.training and len(model.modes) == 3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_bad_arguments_raise_naming_them():
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
    with pytest.raises(ValueError, match=r"precision must be one of \[.*'bf16-mixed'.*\], got 'fp8'"):
        bench.measure_inference(model, (3, 8, 8), 4, precision="fp8")
    with pytest.raises(ValueError, match="need repeats >= 1 and warmup >= 0, got repeats=0, warmup=1"):
        bench.median_seconds(lambda: None, torch.device("cpu"), repeats=0)


def test_peak_memory_sees_a_known_allocation():
    """A 64 MiB tensor written inside ``fn`` raises the peak by about 64 MiB (CPU: peak resident set). Measured
    in a fresh process whose large allocations are their own mappings (glibc's mmap threshold pinned, as the
    attention memory tests do): in a long-lived process a freed, still-resident heap can absorb the tensor."""
    script = ("import torch; from zoo import bench; size = 64 * 2**20; "
              "peak = bench.peak_memory(lambda: torch.ones(size // 4).sum(), torch.device('cpu')); print(peak)")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = out.stdout.strip().splitlines()[-1]
    if peak == "None":
        pytest.skip("no /proc/self/clear_refs on this system: peak_memory cannot measure the CPU")
    size = 64 * 2**20
    assert 0.9 * size <= int(peak) <= size + 48 * 2**20, int(peak) / 2**20


def test_peak_memory_of_a_device_it_cannot_see_is_none_and_runs_nothing():
    """On MPS (or another non-CUDA device) the host's resident set would not be the device's memory."""
    from zoo import bench

    ran = []
    assert bench.peak_memory(lambda: ran.append(1), torch.device("mps")) is None and ran == []


def test_tensor_peak_memory_follows_allocations_and_frees():
    def fn():
        a = torch.empty(1024, 1024)  # 4 MiB
        b = torch.empty(2048, 1024)  # + 8 MiB: 12 held
        del a                        # 8 held
        c = torch.empty(512, 1024)   # 10 held: the peak stays 12
        return b, c

    assert bench.tensor_peak_memory(fn, torch.device("cpu")) == 12 * 2**20
    x = torch.randn(256, 256)
    # a matmul's (256, 256) fp32 output, 256 KiB, under torch's own kernels (2 threads)
    assert bench.tensor_peak_memory(lambda: x @ x, torch.device("cpu")) == 256 * 256 * 4
