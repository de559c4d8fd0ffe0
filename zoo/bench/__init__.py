"""Measuring speed and memory, for users timing their own models as the zoo times its own: timing and memory
primitives (``timing``), the input pipeline's speed (``pipeline``), where a model's training time goes (``parts``),
sliding-window attention, dense vs masked vs banded vs flex (``sparse``, ``python -m zoo.bench.sparse``), the
side-by-side suite that ``eval.py --bench-suite`` runs (``suite``), and ``OpRecorder`` (``dispatch``), which sees every
aten op of a step with its dtypes and host syncs. The project's own records of such measurements, and BENCHMARKS.md
made from them, live beside the package in ``benchmarks/``. Imports ``zoo.data``, ``zoo.runtime``, ``zoo.models``
and ``zoo.layers``."""

from .pipeline import measure_throughput
from .timing import (
    PRECISIONS,
    autocast_for,
    benchmark_model,
    interleaved_medians,
    measure_inference,
    measure_latency,
    measure_training,
    median_seconds,
    peak_memory,
    synchronize,
    tensor_peak_memory,
)

__all__ = [
    "PRECISIONS", "autocast_for", "benchmark_model", "interleaved_medians", "measure_inference",
    "measure_latency", "measure_throughput", "measure_training", "median_seconds", "peak_memory", "synchronize",
    "tensor_peak_memory",
]
