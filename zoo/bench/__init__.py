"""Measuring speed and memory: timing and memory primitives (``timing``), the input pipeline's speed
(``pipeline``), the side-by-side suite that ``eval.py --bench-suite`` runs (``suite``) and sliding-window
attention, dense vs masked vs banded vs flex (``sparse``, ``python -m zoo.bench.sparse``), training
throughput per precision / memory format / compile (``modes``) and the short recipe's ablation, one training
run per variant and seed (``ablation``, ``python -m zoo.bench.ablation``), measurements as data under
``results/`` (``results``) and BENCHMARKS.md rendered from them (``report``, ``python -m zoo.bench.report``).
Imports ``zoo.models`` and ``zoo.layers`` (and ``zoo.train``'s data module for the input-pipeline measurement)."""

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
