"""The one description of the machine a number comes from: ``machine_facts`` (what a results file records: an
``id`` that groups measurements of one kind of machine, the CPU's name, vendor, family / model, the flags that
decide bf16 speed, cores, torch's threads, memory, the GPU) and ``machine_name``, the line a run prints and its
summary.json records (the CPU with its cores and whether it computes bf16 natively, or the GPU's name)."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch

from .device import cpu_has_native_bf16


def _cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo."""
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_facts(cpuinfo: str | None = None, meminfo: str | None = None) -> dict:
    """This machine from /proc/cpuinfo and /proc/meminfo (or the texts given) and torch. ``id`` is
    ``<vendor>-f<family>-m<model>`` (plus ``-<gpu>`` with one), so runs on one kind of machine group together."""
    info = _cpuinfo_fields(_read("/proc/cpuinfo") if cpuinfo is None else cpuinfo)
    meminfo = _read("/proc/meminfo") if meminfo is None else meminfo
    flags = set(info.get("flags", "").split())
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(info.get("vendor_id", ""),
                                                                  info.get("vendor_id", platform.machine()).lower())
    family = int(info["cpu family"]) if info.get("cpu family", "").isdigit() else None
    model = int(info["model"]) if info.get("model", "").isdigit() else None
    mem = re.search(r"MemTotal:\s+(\d+) kB", meminfo)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    ident = f"{vendor}-f{family}-m{model}" + (f"-{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}" if gpu else "")
    return {"id": ident, "cpu": info.get("model name", platform.processor() or platform.machine()),
            "vendor": vendor, "family": family, "model": model,
            "flags": {"avx512_bf16": "avx512_bf16" in flags, "amx": bool({"amx_bf16", "amx_tile"} & flags)},
            "cores": cpu_cores(), "threads": torch.get_num_threads(),
            "memory_gib": round(int(mem.group(1)) / 2**20) if mem else None, "gpu": gpu}


def machine_name(accelerator: str = "cpu") -> str:
    """What a run's numbers come from, e.g. "AMD EPYC (2 cores, native bf16: no)" or a GPU's name."""
    if accelerator == "gpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    if accelerator == "mps":
        return f"Apple MPS ({platform.machine()}, macOS {platform.mac_ver()[0]})"
    name = _cpuinfo_fields(_read("/proc/cpuinfo")).get("model name") or platform.processor() or platform.machine()
    return f"{name} ({cpu_cores()} cores, native bf16: {'yes' if cpu_has_native_bf16() else 'no'})"
