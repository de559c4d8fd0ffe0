"""The prepared GPU check: one command that, on one GPU in a few minutes, runs what only a GPU can show and writes
one report (``gpu_check.json`` + ``gpu_check.md``):

1. ``environment``: torch / CUDA versions, the GPU, native bf16, TF32;
2. ``cuda_tests``: the CUDA-marked tests (``pytest -m cuda``: every attention backend forward and backward in
   bf16 / fp16 against fp32, flex's backward, CBAM / hybrid under autocast, training steps under
   ``torch.cuda.set_sync_debug_mode("error")``);
3. ``vit_tiny``: a short ``train.py --model vit_tiny`` run: images/s, peak GPU memory, MFU against a large bf16
   matmul on the same GPU, and where a step's time goes; ``vit_tiny_step`` the same with ``--compile step`` (the
   forward, loss and backward compiled, replayed as CUDA graphs);
4. ``speedrun``: ``hybrid_tiny`` with ``configs/gpu_speedrun.yaml`` (airbench-sized batch, bf16, compiled, batched
   Muon, TTA): wall seconds to 90% and 94% validation top-1 (94% needs the original CIFAR-10 images; a JPEG copy
   tops out near 91% even for airbench94), and the test top-1;
5. ``anchor``: airbench94 (``airbench94_cpu.py --device cuda --runs 2``, upstream's fp16; its second, warm run)
   on the same GPU and the same JPEG data, beside the speedrun: wall seconds, epochs, images/s and test top-1 with
   TTA of both, and the zoo's wall seconds until its validation top-1 first reached the anchor's test top-1;
6. ``muon``: the batched Muon step against torch's per-matrix loop on the GPU (``benchmarks.muon``);
7. ``suite``: the benchmark suite (``zoo.bench.suite.run_suite``: kernels vs timm and the floor, memory, MFU).

``--dry-run`` runs every step with tiny sizes and no timings on whatever device there is (the default test suite
runs it on the CPU), so the check cannot rot where no GPU is at hand. A step that fails is reported with its error
and the others still run; the exit code is 1 when any step failed. The report is rewritten after every step, and
``--time-limit`` bounds the whole check (a step still running then is stopped; later ones are not run).

    python -m benchmarks.gpu_check --data-dir DATA --out out/gpu_check --time-limit 480
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from zoo.atomic import atomic_write_json, atomic_write_text
from zoo.runtime.console import markdown_table

from .anchor import prepare_anchor_data, run_anchor, side_by_side

REPO = Path(__file__).resolve().parents[2]  # the checkout: train.py, tests/ and configs/ live here
ANCHOR_DIR = REPO.parent / "shared" / "anchors" / "airbench94_cpu"  # where the anchor lies beside a checkout
TARGETS = (0.90, 0.94)  # validation top-1 whose wall time the speedrun reports


def environment() -> dict:
    """What the numbers come from."""
    from zoo.runtime.device import native_bf16
    from zoo.runtime.machine import machine_name

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "machine": machine_name("gpu" if torch.cuda.is_available() else "cpu"),
            # the benchmark suite's (train.py's runs record their own in summary.json: "high" on CUDA, TF32)
            "suite_float32_matmul_precision": torch.get_float32_matmul_precision()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", memory_gb=props.total_memory / 2**30,
                    native_bf16=native_bf16("gpu"))
    return info


def _run(cmd: list[str], log: Path, timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` from the checkout's root, its output written to ``log`` as it comes (a check stopped from outside
    keeps what each step printed); a non-zero exit or the timeout -> RuntimeError with the output's tail."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                                  env=env).returncode
        except subprocess.TimeoutExpired:
            code = f"nothing after {timeout:.0f} s (the check's time limit)"
    output = log.read_text()
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[1:4])} ... exited {code}: {output[-600:]}")
    return subprocess.CompletedProcess(cmd, 0, output, "")


# where the CUDA-marked tests live (a test fails when one is marked elsewhere): collecting only these files keeps
# the check from importing the whole suite
CUDA_TEST_FILES = ("tests/gpu/test_cuda.py", "tests/train/test_randaugment.py")


def cuda_tests(out: Path, timeout: float = 900) -> dict:
    """``pytest -m cuda`` over ``CUDA_TEST_FILES``; counts from its closing line. Without a GPU every test skips
    (the dry run checks that they are collected and importable)."""
    # -n 0: one process, as the GPU is one device (workers would share its memory and its timings)
    done = _run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-n", "0", "-p", "no:cacheprovider",
                 *CUDA_TEST_FILES], out / "cuda_tests.log", timeout)
    last = next(line for line in reversed(done.stdout.splitlines()) if " in " in line and line.strip())
    counts = {word: int(n) for n, word in
              (part.strip().split()[:2] for part in last.split(" in ")[0].split(",")) if n.isdigit()}
    return {"summary": last, **counts}


def train_run(out: Path, name: str, args: list[str], timeout: float) -> Path:
    """``train.py`` as a user runs it; the run directory (the last line it prints on stdout: the log holds stderr
    too, so the last line naming a run directory)."""
    done = _run([sys.executable, "train.py", *args, "--out", str(out / "runs")], out / f"{name}.log", timeout)
    return next(Path(line.strip()) for line in reversed(done.stdout.splitlines())
                if line.strip() and (Path(line.strip()) / "summary.json").is_file())


def _data_args(data_dir: str | None, dry_run: bool) -> list[str]:
    args = ["--data-dir", data_dir] if data_dir else []
    if dry_run:  # a few steps on a slice of the data: the path, not the numbers
        args += ["--max-train-images", "256", "--max-test-images", "64", "--set", "val_size=64", "--epochs", "1",
                 "--limit-train-batches", "2", "--limit-val-batches", "1", "--limit-test-batches", "1",
                 "--batch-size", "32"]
        if not torch.cuda.is_available():  # a CPU's precision probe measures bf16 against fp32: seconds, no path
            args += ["--precision", "32"]
    return args


def vit_tiny(out: Path, data_dir: str | None, dry_run: bool, timeout: float = 900, compile_step: bool = False) -> dict:
    """A short vit_tiny run of its own recipe: throughput, peak GPU memory and MFU against a large bf16 matmul;
    ``compile_step``: with ``--compile step`` (forward, loss and backward compiled; CUDA graphs). A dry run on a
    CPU leaves that one out: compiling vit_tiny takes a minute there, and eagerly it would repeat the other run
    (tests/train/test_module.py checks the compiled step on the CPU)."""
    from zoo.bench.suite import gemm_peak_flops
    from zoo.models import create_model, model_info

    if compile_step and dry_run and not torch.cuda.is_available():
        return {"not_run": "a dry run on a CPU: compiling vit_tiny would take a minute"}
    name = "vit_tiny_step" if compile_step else "vit_tiny"
    # 60 s, and 90 s with the compile in it: both runs and the other steps fit in about eight minutes
    budget = [] if dry_run else ["--max-time", "00:00:01:30" if compile_step else "00:00:01:00"]
    compiled = ["--compile", "step"] if compile_step else []
    run = train_run(out, name, ["--model", "vit_tiny", *budget, *compiled, *_data_args(data_dir, dry_run)], timeout)
    summary = json.loads((run / "summary.json").read_text())
    flops = model_info(create_model("vit_tiny"))["flops"]
    result = {"run": str(run), "precision": summary["precision"], "train_img_s": summary["train_images_per_s"],
              "train_img_s_after_first_epoch": summary.get("train_images_per_s_after_first_epoch"),
              "peak_memory_gb": summary.get("peak_memory_gb"), "test_top1": summary["test_top1"]}
    if not dry_run and torch.cuda.is_available():
        peak = gemm_peak_flops(device="cuda", dtype=torch.bfloat16)
        later = summary.get("train_images_per_s_after_first_epoch")  # without compilation and warm-up
        result.update(matmul_peak_tflops=peak / 1e12, mfu=3 * flops * summary["train_images_per_s"] / peak,
                      mfu_after_first_epoch=3 * flops * later / peak if later else None)
    profile = step_profile("vit_tiny", batch=8 if dry_run else 256, steps=2 if dry_run else 20,
                           compile_step=compile_step)
    return {**result, **profile}


def step_profile(name: str, batch: int, steps: int, compile_step: bool = False) -> dict:
    """Where a training step's time goes (forward, loss, backward, AdamW on random images; bf16 autocast on CUDA;
    ``compile_step``: the forward and loss of ``compile: step``):
    the wall milliseconds of a step against the milliseconds the device spends in kernels (torch.profiler), the
    kernels the device runs per step and the launches the host makes for them (a CUDA graph's replay is one
    launch of many kernels). A device-busy share well under 1 means the host (Python, launches) sets the pace;
    ``top_device_ops`` names the five ops with the most device time. Without a GPU the device figures are 0."""
    from torch.profiler import ProfilerActivity, profile

    from zoo.bench.timing import median_seconds, training_step
    from zoo.models import create_model
    from zoo.train.step import compiled_train_loss

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    step = training_step(create_model(name).to(device), batch=batch, precision="bf16-mixed" if cuda else "32",
                         loss=compiled_train_loss(device.type) if compile_step else None)
    wall = median_seconds(step, device, warmup=3, repeats=steps)  # without the profiler's own overhead
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    kernels = device_kernels(prof.key_averages())
    busy = sum(e.self_device_time_total for e in kernels) / 1e3 / steps  # microseconds -> ms per step
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:5]
    return {"profile_batch": batch, "step_ms": 1e3 * wall, "device_busy_ms": busy,
            "device_busy_share": busy / (1e3 * wall), "device_kernels_per_step": sum(e.count for e in kernels) / steps,
            "host_launches_per_step": sum(e.count for e in host_launches(prof.key_averages())) / steps,
            "top_device_ops": [{"op": e.key[:80], "ms_per_step": e.self_device_time_total / 1e3 / steps}
                               for e in top]}


def device_kernels(events) -> list:
    """The profiler's averaged events that are GPU kernels and copies: on the device, and not a user annotation
    (``Optimizer.step#AdamW.step`` spans its kernels on the GPU timeline too, so counting it would count them
    twice; torch's own table leaves annotations out of its device total the same way)."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)]


# the CUDA runtime and driver calls that queue work on the device, as the profiler names them
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                          "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync"})


def host_launches(events) -> list:
    """The profiler's averaged events that are the host's calls queueing work on the GPU (``LAUNCH_CALLS``)."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.key in LAUNCH_CALLS]


def time_to(metrics_csv: Path, targets=TARGETS) -> dict:
    """Wall seconds of the fit (``time/elapsed_s``, logged at each validation) when validation top-1 first
    reached each target, or None. Top-1 is logged in float32 (900 of 1,000 reads 0.8999999761581421), hence the
    tolerance."""
    with open(metrics_csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/top1") and r.get("time/elapsed_s")]
    return {f"seconds_to_{round(100 * t)}": next((float(r["time/elapsed_s"]) for r in rows
                                                   if float(r["val/top1"]) >= t - 1e-6), None) for t in targets}


def speedrun(out: Path, data_dir: str | None, dry_run: bool, timeout: float = 1200) -> dict:
    """hybrid_tiny with the GPU recipe: time to 90% / 94% validation top-1, test top-1, and which data it ran on."""
    config = str(REPO / "configs" / "gpu_speedrun.yaml")
    eager = ["--set", "compile=false"] if dry_run and not torch.cuda.is_available() else []  # a minute on a CPU
    run = train_run(out, "speedrun", ["--model", "hybrid_tiny", "--config", config, *eager,
                                      *_data_args(data_dir, dry_run)], timeout)
    summary = json.loads((run / "summary.json").read_text())
    jpeg = bool(data_dir) and any(Path(data_dir, "train").glob("*/*.jpg"))
    return {"run": str(run), "data": "JPEG image folder" if jpeg else "CIFAR-10 batches (original images)",
            "epochs": summary["epochs"], "wall_time_s": summary["wall_time_s"], "test_top1": summary["test_top1"],
            "train_img_s": summary["train_images_per_s"],
            "train_img_s_after_first_epoch": summary.get("train_images_per_s_after_first_epoch"),
            **time_to(run / "metrics.csv"),
            **epoch_times(run / "metrics.csv")}


def anchor(out: Path, anchor_dir: Path, data_dir: str | None, dry_run: bool, speedrun_report: dict | None,
           timeout: float = 600) -> dict:
    """airbench94 on this device as upstream runs it (on CUDA: fp16, two runs, the second read; a dry run: 10 images a
    class, a fifth of an epoch), and beside it the speedrun's figures (``speedrun_report``, when it ran)."""

    script = anchor_dir / "airbench94_cpu.py"
    if not script.is_file():
        raise FileNotFoundError(f"no airbench94_cpu.py in {anchor_dir} (give --anchor DIR)")
    if not data_dir:
        raise ValueError("the anchor reads the JPEG tree: give --data-dir")
    data = prepare_anchor_data(anchor_dir, data_dir, out, limit=10 if dry_run else 0)
    args = ["--device", "cuda", "--runs", "2"] if torch.cuda.is_available() else []
    found = run_anchor(script, data, *args, *(["--epochs", "0.2", "--batch_size", "64"] if dry_run else []),
                       timeout=timeout)
    result = {"anchor_epochs": found["epochs"], "anchor_wall_s": found["wall_seconds"],
              "anchor_timed_s": found["airbench_timed_seconds"], "anchor_train_img_s": found["train_img_per_s"],
              "anchor_test_top1_tta": found["tta_val_acc"], "anchor_test_top1_plain": found["val_acc"]}
    if speedrun_report and speedrun_report.get("ok"):
        run = Path(speedrun_report["run"])
        reached = time_to(run / "metrics.csv", (found["tta_val_acc"],))
        result.update(zoo_wall_s=speedrun_report["wall_time_s"], zoo_first_epoch_s=speedrun_report["first_epoch_s"],
                      zoo_later_epoch_s=speedrun_report["later_epoch_s"], zoo_epochs=speedrun_report["epochs"],
                      zoo_train_img_s=speedrun_report["train_img_s_after_first_epoch"],
                      zoo_test_top1_tta=speedrun_report["test_top1"],
                      zoo_seconds_to_anchor_top1=next(iter(reached.values())))
    return result


def muon(dry_run: bool) -> dict:
    """Batched Muon against torch's loop on this device, per model (``benchmarks.muon.bench_muon``)."""
    from .muon import bench_muon

    device = "cuda" if torch.cuda.is_available() else "cpu"
    models, repeats = (("vit_nano",), 1) if dry_run else (("vit_tiny", "hybrid_tiny"), 9)
    peak = 1e12 if dry_run else None  # a dry run times no GEMM (bf16 is emulated, minutes, on many CPUs)
    found = {}
    for name in models:
        row = bench_muon(name, repeats, peak, device=device)
        found.update({f"{name}_{key}": value for key, value in row.items() if key != "model"})
    return found


def epoch_times(metrics_csv: Path) -> dict:
    """Wall seconds to the first validation (compilation and warm-up included) and the mean seconds of each
    later epoch (training and validation), from ``time/elapsed_s``."""
    with open(metrics_csv, newline="") as f:
        elapsed = [float(r["time/elapsed_s"]) for r in csv.DictReader(f) if r.get("time/elapsed_s")]
    later = (elapsed[-1] - elapsed[0]) / (len(elapsed) - 1) if len(elapsed) > 1 else None
    return {"first_epoch_s": elapsed[0] if elapsed else None, "later_epoch_s": later}


def _step(report: dict, name: str, fn: Callable[[], dict]) -> None:
    start = time.perf_counter()
    try:
        report[name] = {"ok": True, **fn()}
    except Exception as err:  # one failed step must not cost the others' results
        report[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    report[name]["seconds"] = round(time.perf_counter() - start, 1)
    print(f"gpu_check: {name} {'ok' if report[name]['ok'] else 'FAILED'} in {report[name]['seconds']} s", flush=True)


def markdown(report: dict) -> str:
    """The report as markdown: one section per step, its scalar results as a table."""
    lines = ["# GPU check", ""]
    for step, result in report.items():
        if not isinstance(result, dict):
            lines += [f"- {step}: {result}", ""]
            continue
        lines += [f"## {step}", "", *markdown_table(["key", "value"], [
            [k, f"{v:.4g}" if isinstance(v, float) else v]
            for k, v in result.items() if k != "traceback" and not isinstance(v, (dict, list))])]
        lines.append("")
        if step == "anchor" and result.get("ok"):
            lines += side_by_side(result)
    return "\n".join(lines)


STEPS = ("environment", "cuda_tests", "vit_tiny", "vit_tiny_step", "speedrun", "anchor", "muon", "suite")


def run_check(out: str | Path, data_dir: str | None = None, dry_run: bool = False, skip=(),
              time_limit: float | None = None, anchor_dir: str | Path = ANCHOR_DIR) -> dict:
    """Every step but those in ``skip``, in ``STEPS``' order; OUT/gpu_check.json and OUT/gpu_check.md are written
    after each step, so a check stopped from outside keeps what it measured. ``time_limit`` (seconds): a step's
    subprocess is stopped when it runs out, and steps not begun by then are reported as not run."""
    from zoo.bench.suite import run_suite

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (time_limit or float("inf"))

    def left() -> float:
        return min(max(deadline - time.monotonic(), 1.0), 1800.0)

    steps = {"environment": environment,
             "cuda_tests": lambda: cuda_tests(out, left()),
             "vit_tiny": lambda: vit_tiny(out, data_dir, dry_run, left()),
             "vit_tiny_step": lambda: vit_tiny(out, data_dir, dry_run, left(), compile_step=True),
             "speedrun": lambda: speedrun(out, data_dir, dry_run, left()),
             "anchor": lambda: anchor(out, Path(anchor_dir), data_dir, dry_run, report.get("speedrun"), left()),
             "muon": lambda: muon(dry_run),
             "suite": lambda: {"results": str(out / "suite" / "bench.json"),
                               **_suite_summary(run_suite(out / "suite", data_dir, quick=dry_run))}}
    report: dict = {"dry_run": dry_run, "skipped": list(skip)}
    for name, fn in steps.items():
        if name in skip:
            continue
        if time.monotonic() >= deadline:
            report[name] = {"ok": False, "error": f"not run: the check's time limit of {time_limit:.0f} s was spent"}
            print(f"gpu_check: {name} not run (time limit)", flush=True)
        else:
            _step(report, name, fn)
        atomic_write_json(out / "gpu_check.json", report)
        atomic_write_text(out / "gpu_check.md", markdown(report))
    return report


def _suite_summary(results: dict) -> dict:
    """The suite's headline figures (bench.json keeps them all)."""
    mfu = results["mfu"][0]
    return {"vit_tiny_train_img_s": mfu["train_img_s"], "vit_tiny_mfu": mfu["mfu"],
            "gemm_peak_tflops": mfu["gemm_peak_gflops"] / 1e3}


def results_records(report: dict, out: Path, command: str) -> list[dict]:
    """The check's measurements as ``benchmarks.results`` records: a "gpu" record of every step's scalar results
    (one row each) and, when the suite ran, its "suite" record."""
    from . import results

    rows = [{"step": step, "measure": key, "value": value} for step, found in report.items()
            if isinstance(found, dict) and found.get("ok") and step != "environment"
            for key, value in found.items() if isinstance(value, (int, float)) and not isinstance(value, bool)]
    records = [results.make("gpu", "The prepared GPU check", command, {"rows": rows})] if rows else []
    if report.get("suite", {}).get("ok"):
        records.append(results.from_suite(json.loads((out / "suite" / "bench.json").read_text()), command))
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", help="CIFAR-10 (image folders or cifar-10-batches-py)")
    p.add_argument("--out", required=True, help="folder for the report, the runs and the logs")
    p.add_argument("--dry-run", action="store_true", help="every step at tiny sizes, no timings (any device)")
    p.add_argument("--skip", nargs="*", default=[], choices=STEPS, help="steps to leave out")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="stop a step's subprocess when the check has run this long; later steps are not run")
    p.add_argument("--results", metavar="DIR", help="also record the measurements in DIR (results/) for the report")
    p.add_argument("--anchor", default=str(ANCHOR_DIR), metavar="DIR",
                   help="the folder holding airbench94_cpu.py and prep_data.py (default: shared/anchors/airbench94_cpu "
                        "beside the checkout)")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible; use --dry-run to check the steps on this machine", file=sys.stderr)
        return 2
    report = run_check(args.out, args.data_dir, args.dry_run, args.skip, args.time_limit, args.anchor)
    print(Path(args.out) / "gpu_check.md")
    if args.results and not args.dry_run:  # a dry run's sizes are not numbers to report
        from . import results

        for record in results_records(report, Path(args.out), results.command_line("benchmarks.gpu_check", argv)):
            print(results.write(record, args.results))
    return 0 if all(r["ok"] for r in report.values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
