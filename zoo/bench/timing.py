"""Speed and memory of a model: inference and training throughput, batch-1 latency, peak memory.

Each measurement warms up, then reports the median of several timed repeats (the device is synchronised
around each). ``precision`` is Lightning's spelling: "32" (float32), "bf16-mixed" / "16-mixed" (autocast).
The training step runs on a copy of the model, so the model passed in is left untouched.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.timing import interleaved_medians, synchronize  # noqa: F401  (re-exported: zoo.bench's API)

Shape = tuple[int, int, int]  # (C, H, W) of one image
PRECISIONS = {"32": None, "32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def autocast_for(device: torch.device, precision: str):
    """The autocast context for a Lightning precision string ("32": none) on ``device``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    dtype = PRECISIONS[precision]
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def median_seconds(fn: Callable[[], object], device: torch.device, *, warmup: int = 1,
                   repeats: int = 5) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones."""
    return interleaved_medians({"fn": fn}, device, warmup=warmup, repeats=repeats)["fn"]


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def inference_step(model: nn.Module, input_shape: Shape = (3, 32, 32), batch: int = 256, *,
                   precision: str = "32") -> Callable[[], None]:
    """A closure running one no-grad forward of ``batch`` random images on the model's device."""
    device = _device(model)
    x = torch.randn(batch, *input_shape, device=device)

    def step():
        with torch.no_grad(), autocast_for(device, precision):
            model(x)

    return step


def training_step(model: nn.Module, input_shape: Shape = (3, 32, 32), batch: int = 128, *,
                  num_classes: int = 10, precision: str = "32", dtype: torch.dtype = torch.float32,
                  memory_format: torch.memory_format = torch.contiguous_format,
                  loss: Callable | None = None) -> Callable[[], None]:
    """A closure running one training step (forward, cross-entropy, backward, AdamW step) of ``model`` itself
    on ``batch`` random images of ``dtype`` in ``memory_format``; pass a copy to keep the original weights.
    ``loss``: a ``zoo.train.module.train_loss``-like function to compute the forward and loss with instead."""
    device = _device(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, *input_shape, device=device).to(dtype).contiguous(memory_format=memory_format)
    y = torch.randint(0, num_classes, (batch,), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast_for(device, precision):
            value = loss(model, x, y, 0.0, memory_format)[0] if loss else F.cross_entropy(model(x).float(), y)
        value.backward()
        optimizer.step()

    return step


def measure_inference(model: nn.Module, input_shape: Shape = (3, 32, 32), batch: int = 256, *,
                      precision: str = "32", warmup: int = 1, repeats: int = 5) -> float:
    """Forward images/s in eval mode, ``batch`` images of ``input_shape`` (C, H, W), on the model's device."""
    was_training = model.training
    model.eval()
    try:
        step = inference_step(model, input_shape, batch, precision=precision)
        return batch / median_seconds(step, _device(model), warmup=warmup, repeats=repeats)
    finally:
        model.train(was_training)


def measure_latency(model: nn.Module, input_shape: Shape = (3, 32, 32), *, precision: str = "32",
                    warmup: int = 3, repeats: int = 20) -> float:
    """Median seconds of one batch-1 forward in eval mode."""
    return 1.0 / measure_inference(model, input_shape, 1, precision=precision, warmup=warmup, repeats=repeats)


def measure_training(model: nn.Module, input_shape: Shape = (3, 32, 32), batch: int = 128, *,
                     num_classes: int = 10, precision: str = "32", warmup: int = 1,
                     repeats: int = 5) -> float:
    """Training images/s: forward, cross-entropy, backward and an AdamW step at ``batch``, on a copy of the
    model (same device), so the weights of ``model`` do not change."""
    step = training_step(copy.deepcopy(model).train(), input_shape, batch, num_classes=num_classes,
                         precision=precision)
    return batch / median_seconds(step, _device(model), warmup=warmup, repeats=repeats)


def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def _cuda_peak(fn: Callable[[], object], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def tensor_peak_memory(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes of tensor memory that running ``fn()`` holds above what was held before it: on CUDA the
    caching allocator's peak; on the CPU, whose allocator keeps no statistics, the running sum of the
    profiler's allocation and free events, in time order. Unlike ``peak_memory``'s resident set it leaves out
    allocator slack and Python objects, so small peaks are exact rather than lost in the noise of the heap."""
    if device.type == "cuda":
        return _cuda_peak(fn, device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = torch.autograd.DeviceType.CPU
    # kineto's raw events hold every allocation (+bytes) and free (-bytes); prof.events() folds allocations
    # into the ops that made them, losing their order
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == cpu)
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


def peak_memory(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak memory in bytes that running ``fn()`` adds: on CUDA the allocator's peak; on a Linux CPU the
    growth of the peak resident set (reset through /proc/self/clear_refs first); None where neither exists
    (another device such as MPS, a CPU without /proc such as macOS; ``fn`` is then not run). CPU figures include
    allocator slack (glibc keeps freed blocks): see ``tensor_peak_memory`` for tensors alone."""
    if device.type == "cuda":
        return _cuda_peak(fn, device)
    if device.type != "cpu":  # the resident set would count host memory, not the device's
        return None
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
        base = _proc_status_kb("VmRSS:")
    except OSError:
        return None
    fn()
    return 1024 * (_proc_status_kb("VmHWM:") - base)


def benchmark_model(model: nn.Module, input_shape: Shape = (3, 32, 32), *, num_classes: int = 10,
                    precision: str = "32", infer_batch: int = 256, train_batch: int = 128,
                    repeats: int | None = None) -> dict:
    """All of the above for one model on its current device: {"device", "precision", "inference_images_per_s",
    "training_images_per_s", "latency_ms", "peak_memory_bytes" (one training step), "repeats"}.
    ``repeats`` defaults to 3 on the CPU (about a minute for a small ViT) and 10 on an accelerator."""
    device = _device(model)
    repeats = repeats or (3 if device.type == "cpu" else 10)
    inference = measure_inference(model, input_shape, infer_batch, precision=precision, repeats=repeats)
    training = measure_training(model, input_shape, train_batch, num_classes=num_classes, precision=precision,
                                repeats=repeats)
    latency = measure_latency(model, input_shape, precision=precision, repeats=max(repeats, 5))
    memory = peak_memory(lambda: measure_training(model, input_shape, train_batch, num_classes=num_classes,
                                                  precision=precision, warmup=0, repeats=1), device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type  # "cpu", "mps"
    return {"device": name, "precision": precision, "inference_images_per_s": inference,
            "training_images_per_s": training, "latency_ms": latency * 1000, "peak_memory_bytes": memory,
            "infer_batch": infer_batch, "train_batch": train_batch, "repeats": repeats}


def print_result(result: dict, out: str | None = None) -> None:
    """A benchmark's result as indented JSON on stdout and, with ``out``, in that file."""
    text = json.dumps(result, indent=2)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)
