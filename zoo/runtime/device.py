"""What the device of a run is and can do: which accelerator and precision ``auto`` mean here (on a CPU with native
bf16, the precision a caller measures faster for its model; elsewhere a rule), whether the device computes bf16
natively (``ZOO_NATIVE_BF16`` overrides the CPU detection, so every path runs on any machine) and so which dtype
Muon's iteration runs in, the device an evaluation runs on, and how often a step may read a device value on the
host."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch


def mps_available() -> bool:
    """Whether torch has an Apple-silicon GPU (MPS) here."""
    return torch.backends.mps.is_available()


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 CPU flags of bf16 dot products / tile matmuls
NATIVE_BF16_ENV = "ZOO_NATIVE_BF16"  # 0 | 1: overrides the CPU detection, so any machine can play either kind


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), read from the kernel's CPU flags, unless
    ``ZOO_NATIVE_BF16`` is 0 or 1. Without them torch still runs bf16, emulated, and far slower than fp32
    (oneDNN's "bf16 supported" says only that it runs). A ``ZOO_NATIVE_BF16`` of another value -> ValueError."""
    forced = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"{NATIVE_BF16_ENV} must be 0 or 1 (or unset: detect), got {forced!r}")
        return forced == "1"
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path(cpuinfo).read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return False
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def native_bf16(accelerator: str) -> bool:
    """Whether the run's device computes bf16 natively: on a CPU ``cpu_has_native_bf16``; on a GPU torch's check
    without emulation (``is_bf16_supported()`` alone says yes on GPUs that only emulate it, a T4 or a V100); on
    Apple MPS no (Muon's iteration stays fp32 there)."""
    if accelerator == "gpu":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if accelerator == "mps":
        return False
    return cpu_has_native_bf16()


def resolve_muon_dtype(setting: str, accelerator: str) -> str:
    """The dtype of Muon's Newton-Schulz iteration: ``setting`` ("float32" / "bfloat16"), or for "auto"
    bfloat16 where the device computes it natively and float32 elsewhere, whatever the run's precision: the
    iteration is matmuls only, and emulated bf16 costs up to 160x fp32 on a CPU without it."""
    if setting != "auto":
        return setting
    return "bfloat16" if native_bf16(accelerator) else "float32"


def resolve_precision(precision: str, accelerator: str,
                      faster: Callable[[tuple[str, ...]], str] | None = None) -> str:
    """``auto`` -> bf16-mixed on GPUs that compute it natively, 16-mixed on other GPUs; on a CPU without native
    bf16 (``cpu_has_native_bf16``) 32, and with it ``faster(("32", "bf16-mixed"))``, the one measured faster for the
    model at hand (``zoo.train.loop`` passes ``probes.faster_precision`` on the run's model), or bf16-mixed when no
    ``faster`` is given. Why measure (BENCHMARKS.md, ``benchmarks.modes``): on an Ice Lake CPU without native bf16,
    emulated bf16 is 1.6-3x slower; on a Zen 5 with avx512_bf16 every model measured trained 1.3-2.3x faster in
    bf16-mixed; on an AMX Xeon hybrid_tiny trains 2.7x faster but vit_nano 0.8x (slower)."""
    if precision != "auto":
        return precision
    if accelerator == "gpu":
        return "bf16-mixed" if native_bf16("gpu") else "16-mixed"
    if accelerator == "mps":  # fp32 everywhere MPS runs; mixed precision there is the user's explicit choice
        return "32"
    if not native_bf16("cpu"):
        return "32"
    return faster(("32", "bf16-mixed")) if faster is not None else "bf16-mixed"


def resolve_accelerator(accelerator: str, devices) -> str:
    """``auto`` -> gpu when CUDA is visible, else mps on Apple silicon, else cpu; a GPU or MPS request that cannot be
    met -> ValueError (MPS is one device), as is a device list on the CPU or one naming a GPU that is not there."""
    if accelerator == "mps" or accelerator == "auto" and not torch.cuda.device_count() and mps_available():
        if not mps_available():
            raise ValueError("--accelerator mps requested but torch has no MPS device here (Apple silicon, with "
                             "the macOS version this torch build requires); use --accelerator cpu")
        if isinstance(devices, int) and devices > 1 or isinstance(devices, str) and "," in devices:
            raise ValueError(f"--devices {devices}: Apple MPS is one device; use --devices 1")
        return "mps"
    if accelerator in ("auto", "gpu", "cuda"):
        available = torch.cuda.device_count()
        if accelerator == "auto":
            accelerator = "gpu" if available else "cpu"
        elif not available:
            raise ValueError(f"--accelerator {accelerator} requested but no CUDA GPU is visible; "
                             "use --accelerator cpu")
        else:
            accelerator = "gpu"
        if accelerator == "gpu" and isinstance(devices, int) and devices > available:
            raise ValueError(f"--devices {devices} asks for more GPUs than exist ({available} visible)")
    listed = [int(d) for d in devices.split(",") if d.strip()] if isinstance(devices, str) and devices != "auto" else []
    if listed and accelerator == "cpu":
        raise ValueError(f"--devices {devices} lists GPU indices, but the run is on the CPU (no CUDA GPU visible): "
                         "give a number of processes, e.g. --devices 1")
    if listed and accelerator == "gpu" and max(listed) >= torch.cuda.device_count():
        raise ValueError(f"--devices {devices} names GPU {max(listed)}, but {torch.cuda.device_count()} are visible "
                         f"(indices 0..{torch.cuda.device_count() - 1})")
    return accelerator


def compile_for(setting: bool | str, accelerator: str) -> bool | str:
    """The recipe's ``compile`` where the device has torch.compile; on Apple MPS (a prototype backend there) off,
    said in one line."""
    if accelerator == "mps" and setting:
        print(f"compile: {setting} is off on Apple MPS (torch.compile's MPS backend is a prototype); the model runs "
              "eagerly")
        return False
    return setting


def eval_device(name: str | None = None) -> torch.device:
    """The device to evaluate on: ``name`` ("cpu", "cuda", "cuda:1", "mps", ...) checked against what exists, or by
    default the GPU when there is one (CUDA, else Apple MPS), else the CPU. Not a device, or one this machine lacks
    -> ValueError."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {name!r} (mps too on Apple silicon)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError(f"--device {name}: no CUDA GPU is visible here; use --device cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: only {count} CUDA GPU(s) visible (cuda:0 .. cuda:{count - 1})")
    elif device.type == "mps":
        if not mps_available():
            raise ValueError(f"--device {name}: torch has no MPS device here (Apple silicon); use --device cpu")
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: evaluation runs on cpu or cuda (or mps), got a {device.type} device")
    return device


def host_sync_every(device_type: str) -> int:
    """Optimizer steps between the checks that cost a host sync on an accelerator (the NaN flag; under several
    processes each decision all ranks share, a collective): on a CPU (``device_type`` "cpu") every step, where
    they cost nothing; on a GPU ("cuda", "gpu", "mps") every 50th, under a second of training for the zoo's
    models."""
    return 1 if device_type == "cpu" else 50
