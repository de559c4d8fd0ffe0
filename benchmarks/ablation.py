"""The short recipe's ablation: the CPU recipe's command (``train.py --model hybrid_tiny --config
configs/cpu_budget.yaml --max-time 00:00:10:00``) once per variant and seed, each variant the recipe with one
technique switched off or swapped. Each run's test top-1 with test-time augmentation comes from its
summary.json and without it from ``eval.py --checkpoint`` on the same weights, so the TTA row costs no run.
Variants run seed by seed, interleaved (every variant's seed 0, then every seed 1), so a drift of the machine
spreads over all of them. Results go to ``ablation.csv`` (a finished (variant, seed) is not run again: a
stopped ablation resumes) and ``ablation.md``.

    python -m benchmarks.ablation --data-dir DATA --out out/ablation --seeds 0 1
    ZOO_NATIVE_BF16=0 python -m benchmarks.ablation --data-dir DATA --out out/no_bf16 --seeds 0 --variants recipe adamw

``--set KEY=VALUE`` (repeatable) goes to every variant's command (``--model vit_tiny --set tta=0``).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

from zoo.atomic import atomic_write_csv, atomic_write_text
from zoo.runtime.console import markdown_table

from . import results

# name -> the --set overrides that make it from the recipe; "recipe" is the recipe itself.
VARIANTS: dict[str, tuple[str, ...]] = {
    "recipe": (),
    "no_ema": ("ema_decay=0",),
    "no_whitening": ("fit_whitening=false",),
    "random_flip": ("augment.alternating_flip=false",),
    "no_label_smoothing": ("label_smoothing=0",),
    "adamw": ("optimizer=adamw",),
    "muon_matrices": ("optimizer=muon",),
    "sgd_nesterov": ("optimizer=sgd", "lr=0.1", "weight_decay=5e-4", "momentum=0.9"),
    "no_lr_split": ("no_decay_lr_scale=1",),
    "eager": ("compile=false",),
    "patch_drop": ("model_args.patch_drop_rate=0.5",),  # ViTs only: half the patch tokens in each training step
    # DeiT's hard-label distillation from the shipped hybrid; its rows are never plain ten-minute figures (the
    # teacher's own training is outside the budget), and its results records name the teacher.
    "distill": ("teacher=pretrained:hybrid_tiny",),
    "patch_drop_distill": ("model_args.patch_drop_rate=0.5", "teacher=pretrained:hybrid_tiny"),
    # ViTs only: progressive resizing, 16 x 16 images for the first 90% of the steps, then the full 32 x 32
    "low_res": ("model_args.dynamic_img_size=true", "low_res_size=16", "low_res_until=0.9"),
    "low_res_patch_drop": ("model_args.dynamic_img_size=true", "low_res_size=16", "low_res_until=0.9",
                           "model_args.patch_drop_rate=0.5"),
}
FIELDS = ("variant", "seed", "run_dir", "precision", "optimizer", "steps", "train_images_per_s", "best_val_top1",
          "test_top1_tta", "test_top1_plain")
_TRAIN = "import sys; from zoo.train.cli import main; sys.exit(main(sys.argv[1:]))"
_EVAL = "import sys; from zoo.explain.cli import main; sys.exit(main(sys.argv[1:]))"


def train_command(variant: str, seed: int, *, model: str, config: str, data_dir: str, max_time: str,
                  runs: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """The train.py command line of one (variant, seed); ``extra``: --set overrides of every variant."""
    sets = [arg for item in (*extra, *VARIANTS[variant]) for arg in ("--set", item)]
    return [sys.executable, "-c", _TRAIN, "--model", model, "--config", config, "--data-dir", data_dir,
            "--max-time", max_time, "--seed", str(seed), "--out", str(runs), *sets]


def eval_dir(run_dir: Path) -> Path:
    """Where the plain (no TTA) evaluation of a run goes: the run's own eval/ folder, the one place inside a run
    directory eval.py writes to."""
    return run_dir / "eval"


def run_one(variant: str, seed: int, args: argparse.Namespace) -> dict:
    """Train one (variant, seed), evaluate its tested weights without TTA; its row of ablation.csv."""
    cmd = train_command(variant, seed, model=args.model, config=args.config, data_dir=args.data_dir,
                        max_time=args.max_time, runs=args.out / "runs", extra=tuple(args.set))
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    run_dir = Path(done.stdout.strip().splitlines()[-1])  # train.py prints the run directory last
    summary = json.loads((run_dir / "summary.json").read_text())
    if run_tta(run_dir):
        ckpt = run_dir / "checkpoints" / summary["tested_checkpoint"]
        subprocess.run([sys.executable, "-c", _EVAL, "--checkpoint", str(ckpt), "--out", str(eval_dir(run_dir)),
                        "--data-dir", args.data_dir], check=True, stdout=subprocess.DEVNULL)
        plain = json.loads((eval_dir(run_dir) / "metrics.json").read_text())["test_top1"]
    else:  # the run tested without TTA (--set tta=0): its test is the plain one, nothing to evaluate again
        plain = summary["test_top1"]
    return {"variant": variant, "seed": seed, "run_dir": str(run_dir), "precision": summary["precision"],
            "optimizer": summary.get("optimizer"), "steps": summary["global_step"],
            "train_images_per_s": summary["train_images_per_s"], "best_val_top1": summary["best_val_top1"],
            "test_top1_tta": summary["test_top1"], "test_top1_plain": plain}


def check_settings(p: argparse.ArgumentParser, model: str, config: str, overrides: list[list[str]]) -> None:
    """Each run's recipe (``model``, ``config`` and one list of ``--set`` overrides a run) resolved before the first
    run starts, so that a bad setting stops the command within seconds, in one line (exit 2), and not after the
    runs before it have trained."""
    from zoo.train.recipe import resolve_config

    for sets in overrides:
        try:
            resolve_config(model, config, sets)
        except ValueError as err:
            p.error(f"{' '.join(f'--set {o}' for o in sets)}: {err}")


def run_stopped(tool: str, what: str, err: subprocess.CalledProcessError, table: Path) -> int:
    """A run that exited with an error: one line saying so (its own message is above it) and where the finished
    runs are; the exit status is the run's."""
    print(f"{tool}: {what} stopped (exit {err.returncode}; its message is above); the finished runs are in {table}, "
          "and the same command goes on after them", file=sys.stderr)
    return err.returncode or 1


def run_tta(run_dir: Path) -> int:
    """The test-time augmentation level the run's final test used (its config.yaml's ``tta``)."""
    import yaml

    return int((yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("tta", 0))


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [{**row, "seed": int(row["seed"])} for row in csv.DictReader(f)]


def ablation_table(rows: list[dict]) -> str:
    """Markdown: per variant, test top-1 with and without TTA per seed and their means, and the mean of the
    paired (same seed) differences from the recipe; TTA's own gain is the recipe's TTA minus plain."""
    by = {(r["variant"], int(r["seed"])): r for r in rows}
    base = {seed: r for (v, seed), r in by.items() if v == "recipe"}
    rows = []
    for variant in VARIANTS:
        runs = sorted((seed, r) for (v, seed), r in by.items() if v == variant)
        if not runs:
            continue
        tta = [float(r["test_top1_tta"]) for _, r in runs]
        plain = [float(r["test_top1_plain"]) for _, r in runs]
        paired = [(float(r["test_top1_tta"]) - float(base[s]["test_top1_tta"]),
                   float(r["test_top1_plain"]) - float(base[s]["test_top1_plain"])) for s, r in runs if s in base]
        delta = ["", ""]  # the recipe's own row, or a variant with no recipe run of its seeds
        if paired and variant != "recipe":
            delta = [f"{statistics.mean(p[i] for p in paired):+.4f}" for i in (0, 1)]
        rows.append([variant, " ".join(VARIANTS[variant]) or "(configs/cpu_budget.yaml)",
                     ", ".join(str(s) for s, _ in runs), ", ".join(f"{a:.4f}" for a in tta),
                     f"{statistics.mean(tta):.4f}", delta[0], f"{statistics.mean(plain):.4f}", delta[1],
                     f"{statistics.mean(int(r['steps']) for _, r in runs):.0f}"])
    lines = markdown_table(["variant", "overrides", "seeds", "test top-1, TTA (per seed)", "mean",
                            "vs recipe (paired)", "without TTA: mean", "vs recipe", "steps (mean)"], rows)
    if base:
        gain = statistics.mean(float(r["test_top1_tta"]) - float(r["test_top1_plain"]) for r in base.values())
        lines.append(f"\nTest-time augmentation on the recipe's weights: {gain:+.4f} (mean over seeds).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--model", default="hybrid_tiny")
    p.add_argument("--config", default="configs/cpu_budget.yaml")
    p.add_argument("--max-time", default="00:00:10:00")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override of every variant")
    p.add_argument("--results", metavar="DIR", help="also record each run in DIR (results/) for the report")
    args = p.parse_args(argv)
    check_settings(p, args.model, args.config, [[*args.set, *VARIANTS[v]] for v in args.variants])
    args.out.mkdir(parents=True, exist_ok=True)
    table = args.out / "ablation.csv"
    rows = read_rows(table)
    for seed in args.seeds:
        for variant in args.variants:
            if any(r["variant"] == variant and r["seed"] == seed for r in rows):
                continue
            try:
                rows.append(run_one(variant, seed, args))
            except subprocess.CalledProcessError as err:
                return run_stopped("benchmarks.ablation", f"the {variant} run of seed {seed}", err, table)
            if args.results:  # the run's summary.json (and eval/metrics.json) as a results file
                setting = " ".join(f"--set {o}" for o in (*args.set, *VARIANTS[variant]))
                print(results.write(results.from_run(rows[-1]["run_dir"], setting=setting,
                                                     command=results.command_line("benchmarks.ablation", argv)),
                                    args.results))
            atomic_write_csv(table, FIELDS, rows)  # rewritten whole after each run: a stop loses no row
            atomic_write_text(args.out / "ablation.md", ablation_table(rows))
            print(f"{variant} seed {seed}: test top-1 {rows[-1]['test_top1_tta']:.4f} (TTA), "
                  f"{rows[-1]['test_top1_plain']:.4f} (plain)", flush=True)
    print(ablation_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
