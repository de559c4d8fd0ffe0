"""The zoo's CPU recipe side by side with the convolutional speedrun it must beat: airbench94 ported to the CPU
(``airbench94_cpu.py``, a script kept outside the package; ``--anchor`` names its folder), on the same machine,
in the same precision and the same wall-clock budget, paired the same way on every machine:

1. the anchor's data are decoded once (its ``prep_data.py``) from the same JPEG tree the zoo reads;
2. its own short bench (``--bench_steps``) measures its images/s here, and its epochs are chosen so that training
   plus its test-time-augmented evaluation end near ``--anchor-seconds`` (570 s of a 10-minute budget);
3. per seed, the zoo's run (``train.py --model M --config configs/cpu_budget.yaml --max-time T``, as
   ``benchmarks.ablation`` runs it) and the anchor's run, the order alternating with the seed so that a drift of
   the machine falls on both; both with glibc's malloc keeping freed memory, as the zoo's runs do.

Results go to ``anchor.csv`` (a finished (seed, side) is not run again: a stopped pairing resumes) and
``anchor.md`` (per seed, both test top-1 with TTA, their means with standard errors, the paired difference), and
with ``--results`` each run to ``results/``.

    python -m benchmarks.anchor --anchor ANCHOR_DIR --data-dir DATA --out out/anchor --seeds 0 1 2 --results results
    ZOO_NATIVE_BF16=0 python -m benchmarks.anchor --anchor ANCHOR_DIR --data-dir DATA --out out/anchor_fp32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from zoo.atomic import atomic_write_csv, atomic_write_text
from zoo.runtime.console import markdown_table
from zoo.runtime.memory import MMAP_THRESHOLD, TRIM_THRESHOLD

from . import ablation, results
from .report_targets import show_mean_se

TRAIN_IMAGES, TEST_IMAGES = 50_000, 10_000  # the anchor always trains on all of CIFAR-10's training images
# its final evaluation: 6 forward passes a test image with TTA (mirror, and both one-pixel shifts mirrored) and 1
# without; a forward pass costs about a third of a training step's image
EVAL_PASSES, FORWARD_SHARE = 7, 1 / 3
FIELDS = ("seed", "side", "model", "precision", "epochs", "steps", "train_images_per_s", "test_top1_tta",
          "test_top1_plain", "seconds", "run")
# glibc's malloc tuned as zoo.runtime.memory tunes the zoo's own runs
MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD), "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}


def anchor_epochs(images_per_s: float, seconds: float) -> float:
    """The anchor's epochs (one decimal) whose training and final evaluation take about ``seconds`` at
    ``images_per_s`` training images a second (its bench); ValueError when not even a tenth of an epoch fits."""
    eval_s = EVAL_PASSES * TEST_IMAGES * FORWARD_SHARE / images_per_s
    epochs = math.floor((seconds - eval_s) * images_per_s / TRAIN_IMAGES * 10) / 10
    if epochs < 0.1:
        raise ValueError(f"the anchor trains {images_per_s:.0f} images/s here: {seconds:.0f} s hold less than a "
                         f"tenth of an epoch and its evaluation; give more --anchor-seconds")
    return epochs


def order(seed: int) -> tuple[str, str]:
    """Which side runs first for ``seed``: the zoo on even seeds, the anchor on odd ones."""
    return ("zoo", "anchor") if seed % 2 == 0 else ("anchor", "zoo")


def anchor_precision(precision: str) -> int:
    """The anchor's ``--bf16`` for the zoo's precision ("bf16-mixed" -> 1, "32" -> 0)."""
    if precision not in ("32", "bf16-mixed"):
        raise ValueError(f"--precision must be 32 or bf16-mixed (the anchor has no other), got {precision!r}")
    return int(precision == "bf16-mixed")


def default_precision() -> str:
    """bf16-mixed on a CPU that computes bf16 natively (``ZOO_NATIVE_BF16`` forces it either way), else 32."""
    from zoo.runtime.device import native_bf16

    return "bf16-mixed" if native_bf16("cpu") else "32"


def result_line(stdout: str) -> dict:
    """The anchor's ``RESULT {json}`` line (its last one)."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError("the anchor printed no RESULT line")
    return json.loads(lines[-1][len("RESULT "):])


def run_anchor(script: Path, data: Path, *args: str, timeout: float | None = None) -> dict:
    """One run of the anchor's script with ``args``; its (last) RESULT."""
    done = subprocess.run([sys.executable, str(script), "--data", str(data), "--jsonl", os.devnull, *args],
                          check=True, stdout=subprocess.PIPE, text=True, env={**os.environ, **MALLOC_ENV},
                          timeout=timeout)
    return result_line(done.stdout)


def prepare_anchor_data(anchor: Path, data_dir: str, out: Path, limit: int = 0) -> Path:
    """The anchor's decoded copy of ``data_dir`` (a JPEG tree ``train/<class>/``, ``test/<class>/``; ``limit``
    images a class, 0 for all), made once."""
    folder = out / (f"anchor_data_{limit}" if limit else "anchor_data")
    if not all((folder / f"{split}.pt").is_file() for split in ("train", "test")):
        subprocess.run([sys.executable, str(anchor / "prep_data.py"), "--out", str(folder), "--limit", str(limit)],
                       check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "CIFAR_DIR": str(Path(data_dir).resolve())})
    return folder


def anchor_row(seed: int, precision: str, epochs: float, found: dict) -> dict:
    return {"seed": seed, "side": "anchor", "model": "airbench94", "precision": precision, "epochs": epochs,
            "steps": found["steps"], "train_images_per_s": round(found["train_img_per_s"], 1),
            "test_top1_tta": found["tta_val_acc"], "test_top1_plain": found["val_acc"],
            "seconds": round(found["wall_seconds"], 1), "run": ""}


def anchor_record(row: dict, budget: str, command: str) -> dict:
    """A ``train`` record of one anchor run, read beside the zoo's rows of the same budget."""
    numbers = {"model": "airbench94", "budget": budget, "epochs": row["epochs"], "optimizer": "sgd_nesterov",
               "setting": f"airbench94 port, {row['precision']}, {row['epochs']} epochs",
               "precision": row["precision"], "seed": row["seed"], "steps": row["steps"],
               "train_images_per_s": row["train_images_per_s"], "best_val_top1": None,
               "test_top1": row["test_top1_tta"], "test_top1_plain": row["test_top1_plain"], "tta": True}
    return results.make("train", "airbench94 on the CPU, the reference", command, numbers,
                        note=f"The reference network, not a zoo model, paired with the zoo's seed-{row['seed']} run "
                             f"by benchmarks.anchor; it took {row['seconds']} s.")


def zoo_settings(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides of the zoo's runs: the pairing's precision, then the command's own."""
    return [f"precision={args.precision}", *args.set]


def zoo_row(seed: int, args: argparse.Namespace) -> dict:
    """The zoo's run of ``seed`` (``ablation.run_one``'s recipe variant, in the pairing's precision)."""
    found = ablation.run_one("recipe", seed, argparse.Namespace(
        model=args.model, config=args.config, data_dir=args.data_dir, max_time=args.max_time, out=args.out,
        set=zoo_settings(args)))
    summary = json.loads((Path(found["run_dir"]) / "summary.json").read_text())
    return {"seed": seed, "side": "zoo", "model": args.model, "precision": found["precision"], "epochs":
            summary["epochs"], "steps": found["steps"], "train_images_per_s": found["train_images_per_s"],
            "test_top1_tta": found["test_top1_tta"], "test_top1_plain": found["test_top1_plain"],
            "seconds": summary["wall_time_s"], "run": found["run_dir"]}


def pairing_table(rows: list[dict]) -> str:
    """Markdown: per seed both sides' test top-1 (TTA, and plain), the means ± standard errors, and the mean
    paired difference zoo - anchor with its standard error."""
    by = {(int(r["seed"]), r["side"]): r for r in rows}
    seeds = sorted({seed for seed, _ in by})
    rows = []
    for seed in seeds:
        zoo, anchor = by.get((seed, "zoo")), by.get((seed, "anchor"))
        cell = {side: f"{float(r['test_top1_tta']):.4f} / {float(r['test_top1_plain']):.4f}" if r else "—"
                for side, r in (("zoo", zoo), ("anchor", anchor))}
        delta = f"{float(zoo['test_top1_tta']) - float(anchor['test_top1_tta']):+.4f}" if zoo and anchor else "—"
        rows.append([seed, cell["zoo"], cell["anchor"], anchor["epochs"] if anchor else "—", delta])
    lines = markdown_table(["seed", "zoo (TTA / plain)", "anchor (TTA / plain)", "anchor epochs",
                            "zoo - anchor (TTA)"], rows)
    for side in ("zoo", "anchor"):
        values = [float(r["test_top1_tta"]) for (_, s), r in sorted(by.items()) if s == side]
        if values:
            lines.append(f"\n{side}: test top-1 with TTA {show_mean_se(values)}")
    paired = [float(by[s, "zoo"]["test_top1_tta"]) - float(by[s, "anchor"]["test_top1_tta"])
              for s in seeds if (s, "zoo") in by and (s, "anchor") in by]
    if paired:
        lines.append(f"\nzoo - anchor, paired by seed: {show_mean_se(paired).replace(' (n=', ' (pairs=')}")
    return "\n".join(lines) + "\n"


SIDE_BY_SIDE = (("wall seconds (with compilation / cuDNN tuning)", "wall_s"), ("epochs", "epochs"),
                ("training images/s", "train_img_s"), ("test top-1, TTA", "test_top1_tta"))


def side_by_side(result: dict) -> list[str]:
    """``benchmarks.gpu_check``'s anchor step as one table, airbench94 beside the zoo's speedrun."""
    if "zoo_wall_s" not in result:
        return []
    lines = markdown_table(["", "airbench94", "zoo hybrid_tiny (gpu_speedrun)"], [
        [label, f"{result['anchor_' + key]:.4g}",
         f"{result['zoo_' + key]:.4g}" if result.get("zoo_" + key) is not None else "—"]
        for label, key in SIDE_BY_SIDE])
    reached = result["zoo_seconds_to_anchor_top1"]
    target = f"airbench94's test top-1 ({result['anchor_test_top1_tta']:.4f})"
    when = f"never reached {target}" if reached is None else f"first reached {target} after {reached:.1f} s of its fit"
    lines.append(f"\nThe zoo's validation top-1 {when}; airbench94 timed {result['anchor_timed_s']:.1f} s "
                 "(training and its TTA evaluation).")
    return lines + [""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--anchor", type=Path, required=True, help="the folder holding airbench94_cpu.py and prep_data.py")
    p.add_argument("--data-dir", required=True, help="CIFAR-10 as a JPEG tree (train/<class>/, test/<class>/)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--model", default="hybrid_tiny")
    p.add_argument("--config", default="configs/cpu_budget.yaml")
    p.add_argument("--max-time", default="00:00:10:00")
    p.add_argument("--anchor-seconds", type=float, default=570.0,
                   help="what the anchor's training and final evaluation should fill (default 570 of 600 s)")
    p.add_argument("--bench-steps", type=int, default=6, help="the anchor's short bench, in steps")
    p.add_argument("--precision", choices=("32", "bf16-mixed"), help="both sides' (default: bf16-mixed where the "
                   "CPU computes bf16 natively, else 32)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override of the zoo's run")
    p.add_argument("--results", metavar="DIR", help="also record each run in DIR (results/) for the report")
    args = p.parse_args(argv)
    script = args.anchor / "airbench94_cpu.py"
    if not script.is_file():
        p.error(f"--anchor {args.anchor}: no airbench94_cpu.py there")
    args.precision = args.precision or default_precision()
    ablation.check_settings(p, args.model, args.config, [zoo_settings(args)])
    bf16 = str(anchor_precision(args.precision))
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare_anchor_data(args.anchor, args.data_dir, args.out)
    bench = run_anchor(script, data, "--bench_steps", str(args.bench_steps), "--bf16", bf16)
    epochs = anchor_epochs(bench["img_per_s"], args.anchor_seconds)
    print(f"anchor: {bench['img_per_s']:.0f} images/s in its bench ({args.precision}): {epochs} epochs fill "
          f"{args.anchor_seconds:.0f} s", flush=True)
    table = args.out / "anchor.csv"
    rows = ablation.read_rows(table)
    command = results.command_line("benchmarks.anchor", argv)
    for seed in args.seeds:
        for side in order(seed):
            if any(r["seed"] == seed and r["side"] == side for r in rows):
                continue
            try:
                if side == "zoo":
                    rows.append(zoo_row(seed, args))
                    record = results.from_run(rows[-1]["run"], setting=f"--set precision={args.precision}",
                                              command=command)
                else:
                    found = run_anchor(script, data, "--epochs", str(epochs), "--seed", str(seed), "--bf16", bf16)
                    rows.append(anchor_row(seed, args.precision, epochs, found))
                    record = anchor_record(rows[-1], args.max_time, command)
            except subprocess.CalledProcessError as err:
                return ablation.run_stopped("benchmarks.anchor", f"the {side} run of seed {seed}", err, table)
            if args.results:
                print(results.write(record, args.results))
            atomic_write_csv(table, FIELDS, rows)  # rewritten whole after each run: a stop loses no row
            atomic_write_text(args.out / "anchor.md", pairing_table(rows))
            print(f"{side} seed {seed}: test top-1 {float(rows[-1]['test_top1_tta']):.4f} (TTA)", flush=True)
    print(pairing_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
