"""Device choices for a run: which accelerator and precision ``auto`` means here, and a device sync for
timings."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_precision(precision: str, accelerator: str) -> str:
    """``auto`` -> bf16-mixed on GPUs that support it, 16-mixed on other GPUs, 32 on CPU."""
    if precision != "auto":
        return precision
    if accelerator == "gpu":
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32"


def resolve_accelerator(accelerator: str, devices) -> str:
    """``auto`` -> gpu when CUDA is visible, else cpu; a GPU request that cannot be met -> ValueError."""
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
    return accelerator
