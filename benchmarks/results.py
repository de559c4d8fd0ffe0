"""Measurements as data: one JSON file per measurement under ``results/``, which ``python -m benchmarks.report``
renders into BENCHMARKS.md and README's results table.

A file holds ``kind`` (one of ``KINDS``), ``title``, ``machine`` (``machine_facts()``: an ``id`` that groups
measurements of one machine, the CPU's name, vendor, family / model, the flags that decide bf16 speed, cores,
memory, GPU), ``command`` (what to run to measure it again), ``versions`` (python, torch, timm, lightning, zoo),
``date`` (YYYY-MM-DD) and ``numbers`` (the kind's fields, ``REQUIRED``), optionally ``note``. ``write`` refuses
a file that ``validate`` finds wrong; ``read`` / ``read_all`` validate what they load.

    python -m benchmarks.results RUN_DIR [RUN_DIR ...] --out results   # a training run's summary.json as a file
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

from zoo.atomic import atomic_write_text
from zoo.runtime.machine import machine_facts

KINDS = ("train", "shipped", "model_info", "modes", "optimizer_cost", "muon", "suite", "sparse", "faithfulness",
         "gpu", "compiled_step", "tried")
# The fields each kind's ``numbers`` must have; a kind measured as a table has ``rows``.
REQUIRED = {
    "train": ("model", "budget", "setting", "precision", "seed", "steps", "train_images_per_s", "test_top1", "tta"),
    "shipped": ("model", "test_top1", "test_top1_tta", "test_images"),
    "model_info": ("rows",), "modes": ("rows",), "optimizer_cost": ("rows",), "muon": ("rows",),
    "suite": ("attention_op", "whole_model"), "sparse": ("rows", "claims"), "faithfulness": ("rows",),
    "gpu": ("rows",), "compiled_step": ("rows",),
    # a change tried toward a target: its metric per seed with it and without it (benchmarks.report_targets)
    "tried": ("target", "metric", "budget", "precision", "rows"),
}
ROW_FIELDS = {"tried": ("change", "with", "without")}  # what each of a kind's rows must have
MACHINE_FIELDS = ("id", "cpu", "vendor", "family", "model", "flags", "cores", "memory_gib", "gpu")
VERSION_FIELDS = ("python", "torch", "timm", "lightning", "zoo")
FLAGS = ("avx512_bf16", "amx")  # what decides whether bf16 is native on a CPU


class ResultError(ValueError):
    """A results file that is not one (names the file and what is wrong)."""


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
    except OSError:
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def versions() -> dict:
    """python, torch, timm, lightning and zoo versions (zoo's with the git commit when in a checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    import timm

    try:
        zoo_version = version("zoo")
    except PackageNotFoundError:  # run from a checkout that is not installed
        zoo_version = "unknown"
    try:
        import lightning
        lightning_version = lightning.__version__
    except ImportError:
        lightning_version = None
    commit = _git_commit()
    return {"python": platform.python_version(), "torch": torch.__version__, "timm": timm.__version__,
            "lightning": lightning_version, "zoo": f"{zoo_version} (git {commit})" if commit else zoo_version}


# path flags whose values are written as placeholders: a record names no folder of the machine it ran on
PATH_PLACEHOLDERS = {"--data-dir": "DATA", "--out": "OUT", "--cache-dir": "CACHE", "--anchor": "ANCHOR_DIR"}


def command_line(module: str, argv=None) -> str:
    """How this command was run, for a record: ``python -m MODULE ARGS``, or ``python MODULE ARGS`` for a script
    such as eval.py (``argv`` or the process's arguments),
    each argument quoted only where the shell needs it and each path of ``PATH_PLACEHOLDERS`` as its placeholder."""
    import shlex

    args, shown = [str(a) for a in (sys.argv[1:] if argv is None else argv)], []
    for i, arg in enumerate(args):
        flag, sep, _ = arg.partition("=")
        if sep and flag in PATH_PLACEHOLDERS:
            arg = f"{flag}={PATH_PLACEHOLDERS[flag]}"
        elif i and args[i - 1] in PATH_PLACEHOLDERS:
            arg = PATH_PLACEHOLDERS[args[i - 1]]
        shown.append(arg)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("ZOO_NATIVE_BF16",) if k in os.environ)
    program = f"python {module}" if module.endswith(".py") else f"python -m {module}"
    return " ".join(x for x in (env, program, shlex.join(shown)) if x)


def validate(result: dict, where: str = "result") -> dict:
    """``result`` if it is a well-formed results record, else ResultError naming ``where`` and the problem."""
    if not isinstance(result, dict):
        raise ResultError(f"{where}: expected a JSON object, got {type(result).__name__}")
    missing = [k for k in ("kind", "title", "machine", "command", "versions", "date", "numbers") if k not in result]
    if missing:
        raise ResultError(f"{where}: missing {', '.join(missing)}")
    if result["kind"] not in KINDS:
        raise ResultError(f"{where}: kind must be one of {', '.join(KINDS)}, got {result['kind']!r}")
    for name, fields in (("machine", MACHINE_FIELDS), ("versions", VERSION_FIELDS)):
        lacking = [k for k in fields if not isinstance(result[name], dict) or k not in result[name]]
        if lacking:
            raise ResultError(f"{where}: {name} lacks {', '.join(lacking)}")
    flags = result["machine"]["flags"]
    if not isinstance(flags, dict) or set(flags) != set(FLAGS):
        raise ResultError(f"{where}: machine.flags must have exactly {', '.join(FLAGS)}")
    try:
        datetime.date.fromisoformat(str(result["date"]))
    except ValueError:
        raise ResultError(f"{where}: date must be YYYY-MM-DD, got {result['date']!r}") from None
    if not str(result["command"]).strip():
        raise ResultError(f"{where}: command is empty")
    numbers = result["numbers"]
    lacking = [k for k in REQUIRED[result["kind"]] if not isinstance(numbers, dict) or k not in numbers]
    if lacking:
        raise ResultError(f"{where}: numbers of a {result['kind']} result lack {', '.join(lacking)}")
    if "rows" in numbers and (not isinstance(numbers["rows"], list) or not numbers["rows"]):
        raise ResultError(f"{where}: numbers.rows must be a non-empty list")
    for i, row in enumerate(numbers.get("rows", [])):
        lacking = [k for k in ROW_FIELDS.get(result["kind"], ()) if not isinstance(row, dict) or k not in row]
        if lacking:
            raise ResultError(f"{where}: numbers.rows[{i}] of a {result['kind']} result lacks {', '.join(lacking)}")
    return result


def significant(value, digits: int = 4):
    """``value`` with every float in it (through dicts and lists) rounded to ``digits`` significant digits: timings
    carry a few per cent of noise, so a record keeps no more digits than that."""
    if isinstance(value, dict):
        return {k: significant(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [significant(v, digits) for v in value]
    return float(f"{value:.{digits}g}") if isinstance(value, float) else value


def make(kind: str, title: str, command: str, numbers: dict, *, note: str | None = None,
         machine: dict | None = None, date: str | None = None) -> dict:
    """A validated record of a measurement made now, on this machine (or the ``machine`` / ``date`` given)."""
    result = {"kind": kind, "title": title, "machine": machine or machine_facts(), "command": command,
              "versions": versions(), "date": date or datetime.date.today().isoformat(), "numbers": numbers}
    if note:
        result["note"] = note
    return validate(result)


def _minutes(budget: str) -> str:
    """"00:01:40:00" -> "100min" (DD:HH:MM:SS); anything else as it is."""
    parts = budget.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        return budget
    days, hours, minutes, seconds = (int(p) for p in parts)
    return f"{days * 1440 + hours * 60 + minutes + seconds / 60:g}min"


def file_name(result: dict) -> str:
    """``<date>_<kind>_<machine id>[_<model>-<budget>-<setting>-s<seed>].json`` (the part in brackets for a
    train or shipped result; a setting over 48 characters as its first 40 and a digest of it), safe as a file
    name."""
    n, what = result["numbers"], ""
    if result["kind"] in ("train", "shipped"):
        setting = n.get("setting", "")
        if len(setting) > 48:  # cut short, with a digest of the whole: "=0.75" never reads "=0.7" in a name
            setting = f"{setting[:40]}-{hashlib.sha1(setting.encode()).hexdigest()[:7]}"
        what = "-".join(str(x) for x in (n["model"], _minutes(n.get("budget", "")), setting,
                                         f"s{n['seed']}" if "seed" in n else "") if x)
    parts = (result["date"], result["kind"], result["machine"]["id"], what)
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", "_".join(x for x in parts if x)).replace("--", "-") + ".json"


def write(result: dict, folder: str | Path) -> Path:
    """Validate ``result`` and write it as ``folder/file_name(result)`` (atomically; a name taken by another
    measurement gets a numbered suffix). Returns the path."""
    validate(result)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path, stem, k = folder / file_name(result), file_name(result)[:-5], 1
    text = json.dumps(result, indent=2, sort_keys=True) + "\n"
    while path.exists() and path.read_text() != text:
        k += 1
        path = folder / f"{stem}-{k}.json"
    atomic_write_text(path, text)
    return path


def read(path: str | Path) -> dict:
    """One results file, validated; ResultError names the file when it is not JSON or not a record."""
    try:
        result = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ResultError(f"{path}: not JSON ({e})") from None
    return validate(result, str(path))


def read_all(folder: str | Path) -> list[dict]:
    """Every ``*.json`` of ``folder``, validated, in file-name order (so a rendering of them is deterministic)."""
    return [read(p) for p in sorted(Path(folder).glob("*.json"))]


def from_run(run_dir: str | Path, *, setting: str = "", command: str | None = None) -> dict:
    """A ``train`` record of a finished training run, from its summary.json and config.yaml (and, when it has
    one, ``eval/metrics.json``: the same weights without TTA). ``setting`` names the command's overrides beyond
    ``--model M --config configs/cpu_budget.yaml --max-time T`` ("" for none); the budget is the run's
    ``max_time``, or its epochs when it had none."""
    import yaml

    run_dir = Path(run_dir)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise ResultError(f"{run_dir}: not a finished run ({e})") from None
    # a distilled run is its own row, never a plain one (named once: --teacher X or --set teacher=X)
    if config.get("teacher") and "--teacher" not in setting and "teacher=" not in setting:
        setting = f"{setting} --teacher {config['teacher']}".strip()
    numbers = {"model": summary.get("model", config.get("model")),
               "budget": config.get("max_time") or f"{config.get('epochs')} epochs",
               "epochs": summary.get("epochs"),
               "setting": setting, "precision": summary["precision"], "seed": config.get("seed", 0),
               "steps": summary["global_step"], "train_images_per_s": summary["train_images_per_s"],
               "best_val_top1": summary.get("best_val_top1"), "test_top1": summary["test_top1"],
               "tta": bool(config.get("tta", 0)), "optimizer": summary.get("optimizer", config.get("optimizer"))}
    plain = run_dir / "eval" / "metrics.json"
    if plain.is_file():
        numbers["test_top1_plain"] = json.loads(plain.read_text())["test_top1"]
    length = f"--max-time {config['max_time']}" if config.get("max_time") else f"--epochs {config.get('epochs')}"
    command = command or (f"python train.py --model {numbers['model']} --config configs/cpu_budget.yaml "
                          f"--data-dir DATA {length} --seed {numbers['seed']} {setting}").strip()
    return make("train", f"{numbers['model']}, {numbers['budget']} of training", command, numbers)


def from_suite(found: dict, command: str) -> dict:
    """The suite's results (``run_suite``'s, as its bench.json holds them) as a "suite" record, in the report's
    fields."""
    from zoo.bench.suite import gemm_setting
    from zoo.bench.timing import PRECISIONS

    model, mfu = found["models"][0], found["mfu"][0]
    precision = model["precision"]
    numbers = {
        "attention_op": [{"n": r["n"], "zoo_ms": r["zoo_ms"], "timm_ms": r["timm_ms"], "floor_ms": r["floor_ms"]}
                         for r in found["attention_op"]],
        "attention_op_setting": f"forward + backward, B=32, 3 heads, head dim 64, precision {precision}",
        "whole_model": [{"mode": f"training (batch {model['train_batch']}, forward + backward + AdamW)",
                         "zoo": model["zoo_train_img_s"], "timm": model["timm_train_img_s"]},
                        {"mode": f"inference (batch {model['infer_batch']})", "zoo": model["zoo_infer_img_s"],
                         "timm": model["timm_infer_img_s"]}],
        "whole_model_setting": f"{model['model']} against timm's VisionTransformer of the same configuration, "
                               f"precision {precision}, images/s",
        "memory": [{"backend": r["backend"], "inference_mib": r["inference_mb"], "train_mib": r["backward_mb"]}
                   for r in found["memory"]],
        "memory_setting": f"peak memory of one attention call, B=1, 3 heads, head dim 64, N={found['memory'][0]['n']}",
        "training_images_per_s": {r["model"]: r["train_img_s"] for r in found["training_speed"]},
        "training_setting": f"batch {model['train_batch']}, precision {precision}",
        "mfu": {"model": mfu["model"], "achieved_gflops": mfu["achieved_gflops"],
                "gemm_gflops": mfu["gemm_peak_gflops"], "mfu": mfu["mfu"]},
        # bench.json files written before the GEMM was recorded: gemm_peak_flops' default for the device
        "mfu_setting": mfu.get("gemm") or gemm_setting(torch.device("cuda" if found["machine"].get("gpu") else "cpu"),
                                                       PRECISIONS[precision] or torch.float32),
        "pipeline_images_per_s": found["pipeline"]["img_s"],
        "pipeline_setting": f"batches of {found['pipeline']['batch']} from the uint8 cache on the device, "
                            f"{found['pipeline'].get('augment', 'crop + flip')} augmentation, normalised"}
    return make("suite", "Attention and whole models against timm and the bare-torch floor", command,
                significant(numbers))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.results", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished training runs (summary.json, config.yaml)")
    p.add_argument("--out", default="results", help="the results folder")
    p.add_argument("--setting", default="", help='the run\'s overrides of the CPU recipe\'s command, e.g. '
                                                 '"--precision 32" ("" for none)')
    p.add_argument("--command", help="the command that ran (default: the CPU recipe's, from the run's config)")
    args = p.parse_args(argv)
    try:
        for run in args.runs:
            print(write(from_run(run, setting=args.setting, command=args.command), args.out))
    except ResultError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
