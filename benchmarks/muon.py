"""Muon's optimizer step on a model's Muon tensors, side by side: torch's ``Muon`` (one Newton-Schulz iteration per
matrix, always in bf16) against the zoo's ``FilterMuon`` (one iteration per shape over every matrix of that shape or
its transpose) in bf16 and in fp32, the steps interleaved (``interleaved_medians``). The speed-up of batching is the
launch and kernel overhead a per-matrix loop pays: large on a GPU, smaller on a CPU, where the matmuls' FLOPs
dominate. The floor is the iteration's matmul FLOPs at the bf16 matmul rate the device reaches
(``zoo.bench.suite.gemm_peak_flops``): the time no exact Newton-Schulz in bf16 can beat there, so the loop's time over
the floor bounds the speed-up any batching can give.

    python -m benchmarks.muon --models vit_tiny hybrid_tiny --out muon.json
"""

from __future__ import annotations

import argparse
import math

import torch

from zoo.bench.suite import gemm_peak_flops
from zoo.bench.timing import print_result
from zoo.models import create_model
from zoo.runtime.machine import machine_name
from zoo.runtime.memory import keep_freed_memory
from zoo.runtime.timing import interleaved_medians
from zoo.train.optim import FilterMuon, muon_split, param_groups

from . import results
from .results import command_line

NS_STEPS = 5  # torch's and FilterMuon's default


def newton_schulz_flops(shapes, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of ``steps`` Newton-Schulz iterations over matrices of ``shapes`` (a filter read as a matrix of
    its first dimension by the rest; each taken as m x n with m <= n): per iteration the Gram matrix X Xᵀ (2m²n), its
    square (2m³) and the product with the iterate (2m²n)."""
    total = 0
    for shape in shapes:
        m, n = sorted((shape[0], math.prod(shape[1:])))
        total += steps * (4 * m * m * n + 2 * m**3)
    return total


def muon_matrices(name: str, filters: bool = False, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """The tensors a run's Muon updates (the decayed 2-D weights but the head's; with ``filters`` the conv filters
    too), as new leaf copies on ``device`` with random gradients (the same ones on every device)."""
    model = create_model(name)
    head = {id(p) for p in model.get_classifier().parameters()}
    groups = muon_split(param_groups(model, 2e-3, 0.05), head, filters=filters)[0]
    g = torch.Generator().manual_seed(0)
    copies = []
    for p in (p for group in groups for p in group["params"]):
        copy = torch.nn.Parameter(p.detach().clone().to(device))
        copy.grad = torch.randn(p.shape, generator=g).to(device)
        copies.append(copy)
    return copies


def bench_muon(name: str, repeats: int = 5, peak_bf16_flops: float | None = None,
               device: str | torch.device = "cpu") -> dict:
    """Median milliseconds of one step over ``name``'s 2-D Muon matrices on ``device``: torch's per-matrix loop
    (bf16) and the batched step in bf16 and fp32; the ratios against the loop; the floor (the iteration's FLOPs at
    ``peak_bf16_flops``, measured on ``device`` when None) and the loop's time over it."""
    device = torch.device(device)

    def torch_loop():
        params = muon_matrices(name, device=device)
        return torch.optim.Muon(params, lr=2e-3, weight_decay=0.05, momentum=0.95, nesterov=True,
                                adjust_lr_fn="match_rms_adamw").step

    def batched(dtype: torch.dtype):
        return FilterMuon([{"params": muon_matrices(name, device=device), "weight_decay": 0.05}], lr=2e-3,
                          ns_dtype=dtype).step

    matrices = muon_matrices(name)
    flops = newton_schulz_flops([p.shape for p in matrices])
    floor = flops / (peak_bf16_flops or gemm_peak_flops(device=device, dtype=torch.bfloat16))
    seconds = interleaved_medians({"torch_loop_bf16": torch_loop(), "batched_bf16": batched(torch.bfloat16),
                                   "batched_fp32": batched(torch.float32)}, device, repeats=repeats)
    return {"model": name, "matrices": len(matrices), "shapes": len({tuple(p.shape) for p in matrices}),
            **{f"{k}_ms": 1000 * v for k, v in seconds.items()},
            "batched_bf16_speedup": seconds["torch_loop_bf16"] / seconds["batched_bf16"],
            "batched_fp32_speedup": seconds["torch_loop_bf16"] / seconds["batched_fp32"],
            "newton_schulz_gflop": flops / 1e9, "floor_bf16_ms": 1000 * floor,
            "loop_vs_floor": seconds["torch_loop_bf16"] / floor}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["vit_tiny"], help="registered model names")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--results", metavar="DIR", help="also record the measurement in DIR (results/) for the report")
    args = p.parse_args(argv)
    kept = keep_freed_memory()  # as fit() runs training
    peak = gemm_peak_flops(device="cpu", dtype=torch.bfloat16)
    result = {"machine": machine_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "keep_freed_memory": kept, "peak_bf16_gflops": peak / 1e9,
              "rows": [bench_muon(name, args.repeats, peak) for name in args.models]}
    print_result(result, args.out)
    if args.results:
        record = results.make("muon", "One Muon step over a model's matrices: torch's loop against the zoo's batched "
                              "iteration", command_line("benchmarks.muon", argv),
                              {"rows": results.significant(result["rows"]), "keep_freed_memory": kept,
                               "peak_bf16_gflops": round(peak / 1e9, 1)})
        print(results.write(record, args.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
