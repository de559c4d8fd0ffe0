"""What the training loop costs beyond the arithmetic: train.py's steps against a bare PyTorch loop doing the same
forward, loss, backward and optimizer step on the same batches, on this machine.

Both train vit_nano (batch 32, fp32, AdamW with the recipe's parameter groups, no augmentation, no EMA, no
validation inside the timed steps) on the same CIFAR-10 batches; each step's seconds are read between the ends of
consecutive steps (after ``WARMUP`` steps), and the runs alternate (loop, bare, loop, bare, ...) so a drift of the
machine's speed hits both. The overhead is the loop's median step over the bare loop's, less one: the data indexing
and normalisation, the step function, Fabric's wrappers, the schedule, the epoch's counts, the NaN flag, the
decisions, the clock and the progress line, per step.

    python -m benchmarks.overhead --data-dir DATA --results results
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import results

WARMUP = 10
RECIPE = ["--model", "vit_nano", "--batch-size", "32", "--precision", "32", "--optimizer", "adamw",
          "--set", "ema_decay=0", "--set", "augment.crop_padding=0", "--set", "augment.hflip=false",
          "--set", "augment.randaugment=null", "--set", "augment.mixup_alpha=0", "--set", "augment.cutmix_alpha=0",
          "--set", "model_args.drop_path_rate=0", "--set", "label_smoothing=0.1", "--set", "tta=0",
          "--set", "val_size=32", "--limit-val-batches", "1", "--limit-test-batches", "1",
          "--ckpt-every-n-steps", "100000", "--ckpt-every-minutes", "0", "--epochs", "1"]


class StepTimes:
    """The loop's callback: the clock at the end of every step."""

    def __init__(self):
        self.ends: list[float] = []

    def on_train_batch_end(self, run):
        self.ends.append(time.perf_counter())


def loop_step_seconds(data_dir: str, steps: int, out: Path) -> list[float]:
    """Seconds of each of train.py's steps after the warm-up (one run, in this process)."""
    from zoo.train import cli, loop

    times = StepTimes()
    real = loop.fit
    loop.fit = functools.partial(real, callbacks=[times])
    try:
        code = cli.main([*RECIPE, "--data-dir", data_dir, "--limit-train-batches", str(steps),
                         "--max-train-images", str(32 * steps + 32), "--max-test-images", "32", "--out", str(out),
                         "--cache-dir", str(out / "cache")])
    finally:
        loop.fit = real
    if code:
        raise SystemExit(f"train.py exited with {code}")
    return [b - a for a, b in zip(times.ends[WARMUP:], times.ends[WARMUP + 1:], strict=False)]


def bare_step_seconds(data_dir: str, steps: int, out: Path) -> list[float]:
    """Seconds of each step of a bare loop (the same model, optimizer, batches and loss) after the warm-up."""
    import zoo
    from zoo.data import ImageData
    from zoo.train.optim import build_optimizer, param_groups

    data = ImageData(data_dir, batch_size=32, val_size=32, max_train_images=32 * steps + 32, max_test_images=32,
                     cache_dir=out / "cache", augment={"crop_padding": 0, "hflip": False})
    data.prepare_data()
    data.setup("fit")
    torch.manual_seed(0)
    model = zoo.create_model("vit_nano", num_classes=10, drop_path_rate=0.0).train()
    optimizer = build_optimizer("adamw", param_groups(model, 1e-3, 0.05), 1e-3)
    ends = []
    for images, labels in data.train_dataloader():
        loss = F.cross_entropy(model(data.normalize(images)).float(), labels, label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1:], strict=False)]


def measure(data_dir: str, steps: int, repeats: int) -> dict:
    """Interleaved runs of both; the medians of their step seconds and the overhead."""
    seconds = {"loop": [], "bare": []}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(repeats):
            for name, run in (("loop", loop_step_seconds), ("bare", bare_step_seconds)):
                seconds[name] += run(data_dir, steps, Path(folder) / f"{name}{repeat}")
    loop_s, bare_s = statistics.median(seconds["loop"]), statistics.median(seconds["bare"])
    return {"model": "vit_nano", "batch": 32, "precision": "32", "steps": steps, "repeats": repeats,
            "loop_ms": 1000 * loop_s, "bare_ms": 1000 * bare_s, "overhead": loop_s / bare_s - 1,
            "threads": torch.get_num_threads()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="CIFAR-10 (train/ and test/ class folders, or its batches)")
    p.add_argument("--steps", type=int, default=60, help="training steps a run (the first 10 are not timed)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved")
    p.add_argument("--results", metavar="DIR", help="record the measurement in DIR (results/)")
    args = p.parse_args(argv)
    found = measure(args.data_dir, args.steps, args.repeats)
    print(f"train.py {found['loop_ms']:.2f} ms a step, a bare loop {found['bare_ms']:.2f} ms: overhead "
          f"{100 * found['overhead']:+.2f}%", file=sys.stderr)
    if args.results:
        record = results.make("overhead", "The training loop's cost per step beyond a bare PyTorch loop",
                              results.command_line("benchmarks.overhead", argv), found)
        print(results.write(record, args.results))


if __name__ == "__main__":
    main()
