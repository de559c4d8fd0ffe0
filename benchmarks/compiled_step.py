"""What ``compile: step`` changes in a training step, counted rather than timed: the aten ops one step dispatches
(the profiler's ``aten::`` events: forward, loss, backward, AdamW, the EMA of the weights and the schedule) eagerly
and compiled (Inductor's fused kernels call aten only for matmuls, attention and buffers), and the seconds of the
first compiled step in a first process (an empty compile cache) and in a second one (the cache the first filled:
``compile_cache_hits``). Each process is a fresh interpreter with its own cache folder, so the two compile times
compare a cold machine with a warm one; they are wall seconds, as noisy as the machine is busy.

    python -m benchmarks.compiled_step --models vit_tiny hybrid_tiny --out compiled_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from zoo.bench.timing import print_result
from zoo.models import create_model
from zoo.runtime.machine import machine_name
from zoo.train.compiled import INDUCTOR_CACHE_ENV, CompiledStep, inductor_cache_counts
from zoo.train.optim import WarmupDecay, build_optimizer, ema_multi_avg_fn, param_groups, set_rates
from zoo.train.step import compiled_train_loss, train_loss

from . import results
from .results import command_line


def aten_ops(step) -> int:
    """The aten ops (the profiler's ``aten::`` events, nested ones included) of one call of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(event.name.startswith("aten::") for event in prof.events())


def training_step(name: str, batch: int, compiled: bool):
    """One AdamW training step of ``name`` on a random CIFAR-sized batch, with the EMA of its weights and the
    warm-up + cosine schedule: eager as ``compile: false`` runs it, or as ``compile: step`` does."""
    torch.manual_seed(0)
    model = create_model(name, num_classes=10).train()
    images, targets = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    memory_format = torch.channels_last if name.startswith(("hybrid", "resnet")) else torch.contiguous_format
    model.to(memory_format=memory_format)
    optimizer = build_optimizer("adamw", param_groups(model, 1e-3, 0.05), 1e-3, compiled=compiled)
    averaged = [p.detach().clone() for p in model.parameters()]
    count, average = torch.zeros((), dtype=torch.long), ema_multi_avg_fn(0.99)

    def ema():
        average(averaged, [p.detach() for p in model.parameters()], count)
        count.add_(1)

    if compiled:
        for group in optimizer.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]))
        optimizer = CompiledStep(optimizer)
    schedule, base = WarmupDecay(5, 100), [float(group["lr"]) for group in optimizer.param_groups]
    steps = [0]
    if compiled:
        optimizer.after_step.append(ema)
        optimizer.sync_schedule(schedule, base, 0)
        loss_fn = compiled_train_loss("cpu")
    else:
        loss_fn = train_loss

    def closure():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, images, targets, 0.1, memory_format)[0]
        loss.backward()
        return loss

    def step():
        if not compiled:  # the compiled step writes its rates on the device
            set_rates(optimizer, base, schedule(steps[0]))
        optimizer.step(closure)
        if not compiled:
            ema()
        steps[0] += 1
    return step


def child(name: str, batch: int) -> dict:
    """In this process: the first compiled step's seconds and Inductor's cache counts, then one more step's aten ops
    compiled and eager."""
    compiled = training_step(name, batch, compiled=True)
    before = inductor_cache_counts()
    start = time.perf_counter()
    compiled()
    compile_s = time.perf_counter() - start
    after = inductor_cache_counts()
    eager = training_step(name, batch, compiled=False)
    eager()
    return {"compile_s": compile_s, **{k: after[k] - before[k] for k in after},
            "eager_aten_ops": aten_ops(eager), "compiled_aten_ops": aten_ops(compiled)}


def run_child(name: str, batch: int, cache: str) -> dict:
    """``child`` in a fresh interpreter whose Inductor cache is ``cache``."""
    env = {**os.environ, INDUCTOR_CACHE_ENV: cache}
    out = subprocess.run([sys.executable, "-m", "benchmarks.compiled_step", "--child", name, "--batch", str(batch)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_model(name: str, batch: int, runner=run_child) -> dict:
    """One row: the aten ops of an eager and a compiled step (and their ratio), and the first compiled step's
    seconds and cache counts in a first and a second process sharing a new cache folder."""
    with tempfile.TemporaryDirectory(prefix="zoo-compile-") as cache:
        first, second = runner(name, batch, cache), runner(name, batch, cache)
    return {"model": name, "batch": batch, "eager_aten_ops": first["eager_aten_ops"],
            "compiled_aten_ops": first["compiled_aten_ops"],
            "ops_ratio": first["eager_aten_ops"] / max(first["compiled_aten_ops"], 1),
            "compile_s_first_process": first["compile_s"], "compile_s_second_process": second["compile_s"],
            "cache_misses_first_process": first["compile_cache_misses"],
            "cache_hits_second_process": second["compile_cache_hits"],
            "cache_misses_second_process": second["compile_cache_misses"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["vit_tiny", "hybrid_tiny"], help="registered model names")
    p.add_argument("--batch", type=int, default=32, help="images per step (CIFAR-sized, 32 x 32)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--results", metavar="DIR", help="also record the measurement in DIR (results/) for the report")
    p.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)  # one process's measurement, as JSON
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error(f"--batch must be a positive whole number, got {args.batch}")
    if args.child:
        print(json.dumps(child(args.child, args.batch)))
        return 0
    result = {"machine": machine_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "rows": [bench_model(name, args.batch) for name in args.models]}
    print_result(result, args.out)
    if args.results:
        record = results.make("compiled_step", "The compiled training step: aten ops against the eager step's, "
                              "compile seconds in a first and a second process", command_line(
                                  "benchmarks.compiled_step", argv), {"rows": results.significant(result["rows"])},
                              note="compile seconds are wall time on a machine that may be busy")
        print(results.write(record, args.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
