"""Bad inputs through train.py and eval.py: each ends with one line on stderr that names the problem and exit code
2, no traceback, and changes nothing that was on disk: a finished run is hashed file by file before and after
every wrong resume / evaluation into it, and a failed new run leaves no run directory behind. Most cases call
``main(argv)`` in-process; the ones marked ``from the shell`` run the programs as subprocesses on real CIFAR-10.
(The API side is tests/test_api_bad_inputs.py.)"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import train  # noqa: E402

_spec = importlib.util.spec_from_file_location("eval_cli", REPO / "eval.py")
eval_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_cli)

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under ``folder`` with the SHA-256 of its bytes ("dir" for folders)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def places(tiny_run, cifar_dir, tmp_path_factory) -> dict[str, str]:
    """The paths the cases name: a copy of the finished tiny run (under runs/vit_nano/), real CIFAR-10, a
    2-class ImageFolder of real images, foreign / truncated checkpoints, bad config files."""
    root = tmp_path_factory.mktemp("bad-inputs")
    run = root / "runs" / "vit_nano" / tiny_run.name
    shutil.copytree(tiny_run, run)
    two = root / "two-classes"
    for split, count in (("train", 40), ("test", 8)):
        for name in ("cat", "dog"):
            (two / split / name).mkdir(parents=True)
            for src in sorted((cifar_dir / split / name).iterdir())[:count]:
                shutil.copy(src, two / split / name / src.name)
    torch.save({"weights": torch.zeros(2)}, root / "foreign.ckpt")
    (root / "truncated.ckpt").write_bytes((run / "checkpoints" / "best.ckpt").read_bytes()[:1000])
    (root / "bad.yaml").write_text("lr: [1, 2\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "FILE").write_text("")
    (root / "loose").mkdir()
    shutil.copy(run / "checkpoints" / "last.ckpt", root / "loose" / "last.ckpt")  # outside a run's checkpoints/
    return {"run": str(run), "runs": str(root / "runs"), "ckpt": str(run / "checkpoints" / "best.ckpt"),
            "data": str(cifar_dir), "two": str(two), "tmp": str(root), "cache": str(root / "cache")}


TWO = ["--data-dir", "{two}", "--set", "val_size=8"]  # the 2-class folder (80 training images)


def fill(args: list[str], places: dict[str, str]) -> list[str]:
    return [a.format(**places) for a in args]


def call(main, args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, err: str, match: str, program: str) -> None:
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert ": error: " in err and re.search(match, err), (match, err)


# ----------------------------------------------------------------------------------------- train.py in-process

TRAIN_CASES = [
    ("no model", [], r"no model given: pass --model NAME"),
    ("unknown model", ["--model", "nope"], r"unknown model 'nope'"),
    ("misspelt model", ["--model", "vit_tiyn"], r"did you mean vit_tiny"),
    ("epochs 0", ["--model", "vit_nano", "--epochs", "0"], r"epochs must be a positive integer, got 0"),
    ("batch size -1", ["--model", "vit_nano", "--batch-size", "-1"], r"batch_size must be a positive integer"),
    ("lr -1", ["--model", "vit_nano", "--lr", "-1"], r"lr must be a non-negative number, got -1"),
    ("precision", ["--model", "vit_nano", "--precision", "fp16"], r"precision must be one of auto, 32"),
    ("devices abc", ["--model", "vit_nano", "--devices", "abc"], r"devices must be auto, a number of devices .*'abc'"),
    ("devices 0", ["--model", "vit_nano", "--devices", "0"], r"devices must be .* got 0"),
    ("max-time zero", ["--model", "vit_nano", "--max-time", "00:00:00:00"],
     r"max_time '00:00:00:00' leaves no time for one training step"),
    ("max-time format", ["--model", "vit_nano", "--max-time", "10m"], r"--max-time expects DD:HH:MM:SS"),
    ("batch limit", ["--model", "vit_nano", "--limit-train-batches", "abc"], r"limit_train_batches must be a batch"),
    ("unknown key", ["--model", "vit_nano", "--set", "learning_rate=1"], r"unknown config key 'learning_rate'"),
    ("unknown nested key", ["--model", "vit_nano", "--set", "augment.mixup=0.2"],
     r"unknown config key augment.mixup in --set"),
    ("model_args scalar", ["--model", "vit_nano", "--set", "model_args=3"], r"'model_args' in --set must be a mapping"),
    ("--set without =", ["--model", "vit_nano", "--set", "lr"], r"--set expects key=value, got 'lr'"),
    ("missing config", ["--model", "vit_nano", "--config", "{tmp}/missing.yaml"], r"cannot read config file"),
    ("bad YAML", ["--model", "vit_nano", "--config", "{tmp}/bad.yaml"], r"bad.yaml is not valid YAML"),
    ("YAML list", ["--model", "vit_nano", "--config", "{tmp}/list.yaml"], r"must hold a mapping of keys, got list"),
    ("batch does not divide", ["--model", "vit_nano", *TWO, "--accelerator", "cpu", "--devices", "3", "--batch-size",
                               "32"], r"batch_size 32 is the global batch .* 3 processes .* e\.g\. 30 or 33"),
    ("num-nodes 0", ["--model", "vit_nano", "--num-nodes", "0"], r"num_nodes must be a positive integer"),
    ("ckpt every 0", ["--model", "vit_nano", "--ckpt-every-n-steps", "0"], r"ckpt_every_n_steps must be a positive"),
    ("max-train-images 0", ["--model", "vit_nano", "--max-train-images", "0"], r"max_train_images must be a positive"),
    ("epochs abc", ["--model", "vit_nano", "--epochs", "abc"], r"argument --epochs: invalid int value: 'abc'"),
    ("unknown flag", ["--model", "vit_nano", "--no-such-flag"], r"unrecognized arguments: --no-such-flag"),
    ("seed -1", ["--model", "vit_nano", "--set", "seed=-1"], r"seed must be a non-negative integer, got -1"),
    ("ema_decay 1", ["--model", "vit_nano", "--set", "ema_decay=1.0"], r"ema_decay must lie in \[0, 1\)"),
    ("init_partial", ["--model", "vit_nano", "--set", "init_partial=maybe"], r"init_partial must be true or false"),
    ("resume nowhere", ["--model", "vit_nano", "--resume", "{tmp}/nowhere"], r"no checkpoint at .*nowhere"),
    ("missing data", ["--model", "vit_nano", "--data-dir", "{tmp}/none"], r"data folder .*none does not exist"),
    ("val_size too big", ["--model", "vit_nano", "--data-dir", "{two}", "--set", "val_size=1000"],
     r"val_size must be below the 80 training images"),
    ("out is a file", ["--model", "vit_nano", *TWO, "--out", "{tmp}/FILE"],
     r"cannot write the run directory"),
    ("init-from nothing", ["--model", "resnet18", *TWO, "--init-from", "{ckpt}"],
     r"--init-from .*: no weight matches the model by name and shape"),
    ("init-from under half", ["--model", "vit_nano", "--set", "model_args.depth=16", *TWO, "--init-from", "{ckpt}"],
     r"under 50% of the model was found .*--init-partial"),
    ("init-from missing", ["--model", "vit_nano", *TWO, "--init-from", "{tmp}/missing.ckpt"], r"no checkpoint at"),
]
if not torch.cuda.is_available():
    TRAIN_CASES.append(("gpu without one", ["--model", "vit_nano", "--accelerator", "gpu"], r"no CUDA GPU is visible"))

# wrong resumes of the finished run: each must leave it byte for byte as it was
RESUME_CASES = [
    ("another model", ["--model", "hybrid_tiny", "--resume", "{run}"],
     r"that run trains vit_nano, not --model hybrid_tiny"),
    ("another model, a .ckpt", ["--model", "resnet18", "--resume", "{ckpt}"], r"that run trains vit_nano"),
    ("another model, --ckpt-every-n-steps", ["--model", "hybrid_tiny", "--resume", "{run}", "--ckpt-every-n-steps",
                                             "1"], r"that run trains vit_nano"),
    ("other model_args", ["--model", "vit_nano", "--set", "model_args.depth=2", "--resume", "{run}"],
     r"model arguments differ from the run's \(depth: unset in the run, 2 now\)"),
    ("other img_size", ["--model", "vit_nano", "--set", "img_size=64", "--resume", "{run}"],
     r"img_size: 32 in the run, 64 now"),
    ("auto, other model_args", ["--model", "vit_nano", "--resume", "auto", "--out", "{runs}", "--set",
                                "model_args.drop_path_rate=0.3"], r"model arguments differ"),
    ("other classes", ["--config", "{run}/config.yaml", "--resume", "{run}", "--data-dir", "{two}"],
     r"the run has 10 classes, the data has 2"),  # the run's recipe on other data
    ("other recipe", ["--model", "vit_nano", "--resume", "{run}", *TWO],
     r"the recipe differs from the run's config.yaml \(batch_size: 32 in the run, 256 now, .*val_size: 32 in the "
     r"run, 8 now"),
    ("foreign checkpoint", ["--model", "vit_nano", "--resume", "{tmp}/foreign.ckpt"], r"not a zoo training checkpoint"),
    ("truncated checkpoint", ["--model", "vit_nano", "--resume", "{tmp}/truncated.ckpt"],
     r"not a readable PyTorch checkpoint"),
    ("a checkpoint outside a run", ["--model", "vit_nano", "--resume", "{tmp}/loose/last.ckpt"],
     r"a checkpoint outside a run directory's checkpoints/ folder; pass its run directory, or start a new run "
     r"from its weights with --init-from"),
]


@pytest.mark.parametrize("what, args, match", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_bad_input(what, args, match, places, tmp_path, capsys):
    out = ["--out", str(tmp_path / "runs")] if "--out" not in args else []
    code, _, err = call(train.main, [*fill(args, places), *out, "--cache-dir", places["cache"]], capsys)
    assert_one_line(code, err, match, "train.py")
    assert not any((tmp_path / "runs").glob("*/*")), "a failed train.py left a run directory behind"


def test_a_refused_init_from_fails_before_the_precision_probe(places, tmp_path, capsys, monkeypatch):
    """--precision auto measures fp32 against bf16 for seconds on a CPU with native bf16: a --init-from that
    cannot load is refused before that (and before the run directory exists)."""
    import zoo.train.loop as fit

    monkeypatch.setattr(fit, "resolve_precision", lambda *a: pytest.fail("chose a precision first"))
    args = ["--model", "vit_nano", "--set", "model_args.depth=16", *TWO, "--init-from", "{ckpt}"]
    code, _, err = call(train.main, [*fill(args, places), "--out", str(tmp_path / "runs"), "--cache-dir",
                                     places["cache"]], capsys)
    assert_one_line(code, err, r"under 50% of the model was found", "train.py")


@pytest.mark.parametrize("what, args, match", RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_wrong_resume_changes_nothing(what, args, match, places, capsys):
    before = snapshot(Path(places["runs"]))
    code, _, err = call(train.main, [*fill(args, places), "--cache-dir", places["cache"]], capsys)
    assert_one_line(code, err, match, "train.py")
    assert snapshot(Path(places["runs"])) == before


# ------------------------------------------------------------------------------------------ eval.py in-process

EVAL_CASES = [
    ("device bogus", ["--checkpoint", "{run}", "--device", "bogus"], r"--device must be cpu, cuda or cuda:N"),
    ("device meta", ["--checkpoint", "{run}", "--device", "meta"], r"evaluation runs on cpu or cuda"),
    ("missing checkpoint", ["--checkpoint", "{tmp}/missing.ckpt"], r"no checkpoint at"),
    ("foreign checkpoint", ["--checkpoint", "{tmp}/foreign.ckpt"], r"not a zoo training checkpoint"),
    ("run compared with itself", ["--compare", "{run}", "{run}"], r"--compare got the same run more than once"),
    ("compare a missing run", ["--compare", "{run}", "{tmp}/none"], r"no checkpoint at .*none"),
    ("other classes", ["--checkpoint", "{run}", "--data-dir", "{two}"],
     r"has the classes \['cat', 'dog'\], the run was trained on \['airplane'"),
    ("missing data", ["--checkpoint", "{run}", "--data-dir", "{tmp}/none"], r"does not exist"),
    ("num-images 0", ["--checkpoint", "{run}", "--num-images", "0"], r"--num-images must be >= 1, got 0"),
    ("batch-size 0", ["--checkpoint", "{run}", "--batch-size", "0"], r"--batch-size must be >= 1, got 0"),
    ("no --out", ["--checkpoint", "{run}", "--out"], r"argument --out: expected one argument"),
    ("precision bf16", ["--checkpoint", "{run}", "--benchmark", "--precision", "bf16"],
     r"argument --precision: invalid choice: 'bf16'"),
    ("out is a file", ["--pretrained", "vit_nano", "--out", "{tmp}/FILE"], r"--out .*FILE is a file; name a folder"),
    ("out under a file", ["--faithfulness", "{run}", "--out", "{tmp}/FILE/compare"],
     r"--out .*FILE/compare: .*FILE is a file"),
    ("two modes", ["--checkpoint", "{run}", "--compare", "{run}"], r"not allowed with argument"),
    ("faithfulness-images 0", ["--faithfulness", "{run}", "--faithfulness-images", "0"],
     r"--faithfulness-images must be >= 1, got 0"),
    ("faithfulness, a run twice", ["--faithfulness", "{run}", "{run}"], r"--faithfulness got the same run more"),
    ("faithfulness, a missing run", ["--faithfulness", "{run}", "{tmp}/none"], r"no checkpoint at .*none"),
    ("faithfulness, other classes", ["--faithfulness", "{run}", "--data-dir", "{two}"],
     r"has the classes \['cat', 'dog'\], the run was trained on"),
    ("faithfulness, weights not shipped", ["--faithfulness", "pretrained:vit_tiny"],
     r"the zoo ships no weights for 'vit_tiny'"),
    ("no mode", [], r"one of the arguments --checkpoint --pretrained --compare --faithfulness --report "
                    r"--bench-suite is required"),
]
if not torch.cuda.is_available():
    EVAL_CASES.append(("cuda without a GPU", ["--checkpoint", "{run}", "--device", "cuda"], r"no CUDA GPU is visible"))


@pytest.mark.parametrize("what, args, match", EVAL_CASES, ids=[c[0] for c in EVAL_CASES])
def test_eval_bad_input(what, args, match, places, tmp_path, capsys):
    before = snapshot(Path(places["runs"]))
    out = [] if "--out" in args else ["--out", str(tmp_path / "eval")]
    code, _, err = call(eval_cli.main, [*fill(args, places), *out], capsys)
    assert_one_line(code, err, match, "eval.py")
    assert not (tmp_path / "eval").exists(), "a failed eval.py wrote output"
    assert snapshot(Path(places["runs"])) == before


def test_eval_into_the_run_directory_with_wrong_data_changes_nothing(places, capsys):
    before = snapshot(Path(places["runs"]))
    code, _, err = call(eval_cli.main, ["--checkpoint", places["run"], "--out", places["run"],
                                        "--data-dir", places["two"], "--attention"], capsys)
    assert_one_line(code, err, r"the run was trained on", "eval.py")
    assert snapshot(Path(places["runs"])) == before


def test_at_least_forty_kinds_of_bad_cli_input():
    assert len(TRAIN_CASES) + len(RESUME_CASES) + len(EVAL_CASES) + len(SHELL_CASES) >= 40


# ---------------------------------------------------------------------------------------------- from the shell

# The programs as a shell runs them (``sys.exit(main())``, a fresh interpreter): one argument error, one found after
# the data are read, one of eval.py's; every case here has an in-process twin above, which covers the messages. The
# cases that read data run under -m slow (each a fresh interpreter that imports Lightning and decodes).
SHELL_CASES = [
    pytest.param("train epochs abc", "train.py", ["--model", "vit_nano", "--epochs", "abc"],
                 r"invalid int value: 'abc'", id="train epochs abc"),
    pytest.param("train resume other classes", "train.py", ["--config", "{run}/config.yaml", "--resume", "{run}",
                                                            "--data-dir", "{two}", "--cache-dir", "{cache}"],
                 r"the run has 10 classes, the data has 2",  # the run's own recipe on other data, as its twin
                 id="train resume other classes", marks=pytest.mark.slow),
    pytest.param("eval other classes into the run", "eval.py", ["--checkpoint", "{run}", "--data-dir", "{two}",
                                                                "--out", "{run}"],
                 r"the run was trained on", id="eval other classes into the run", marks=pytest.mark.slow),
]
if not torch.cuda.is_available():
    SHELL_CASES.append(pytest.param("eval cuda without a GPU", "eval.py", ["--checkpoint", "{run}", "--device",
                                                                           "cuda", "--out", "{tmp}/e"],
                                    r"no CUDA GPU is visible", id="eval cuda without a GPU"))


@pytest.mark.parametrize("what, program, args, match", SHELL_CASES)
def test_from_the_shell(what, program, args, match, places):
    before = snapshot(Path(places["runs"]))
    done = subprocess.run([sys.executable, program, *fill(args, places)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert_one_line(done.returncode, done.stderr, match, program)
    assert snapshot(Path(places["runs"])) == before
    assert not any(Path(places["tmp"]).glob("shell-runs/*/*")) and not Path(places["tmp"], "e").exists()


FAST_FAIL = """
import json, sys, time
sys.path.insert(0, ".")
import train  # the front end and zoo (torch, timm) are imported before the clock starts
start = time.perf_counter()
code = train.main(["--model", "nope"])
took = time.perf_counter() - start
from zoo.explain.cli import main as eval_main
eval_code = eval_main(["--checkpoint", "nowhere", "--out", "nowhere", "--device", "bogus"])
heavy = [m for m in ("lightning", "torchmetrics", "matplotlib") if m in sys.modules]
start = time.perf_counter()
import lightning.pytorch, torchmetrics
print(json.dumps({"code": code, "eval_code": eval_code, "took": took, "heavy": heavy,
                  "lightning": time.perf_counter() - start}))
"""


def test_argument_errors_come_before_heavy_imports():
    done = subprocess.run([sys.executable, "-c", FAST_FAIL], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["code"] == seen["eval_code"] == 2 and "unknown model 'nope'" in done.stderr
    assert "--device must be cpu, cuda or cuda:N" in done.stderr
    assert seen["heavy"] == []
    assert seen["took"] < seen["lightning"] / 4, seen  # measured in the same process: ~0.05 s vs ~1 s


# ------------------------------------------------------------------------------------------- what works instead

def test_init_partial_loads_and_says_what_it_loaded(places, tmp_path, capsys):
    args = ["--model", "vit_nano", "--data-dir", places["two"], "--cache-dir", places["cache"], "--init-from",
            places["ckpt"], "--out", str(tmp_path), "--epochs", "1", "--batch-size", "8", "--set", "val_size=8",
            "--limit-train-batches", "1", "--limit-val-batches", "1", "--limit-test-batches", "1"]
    code, out, err = call(train.main, args, capsys)
    assert code == 0, err[-2000:]
    assert re.search(r"--init-from .*best.ckpt: loaded \d+ tensors \((100\.0|9\d\.\d)% of the model's parameter "
                     r"elements\), skipped 2 for shape \(head.bias, head.weight\), 0 missing", out), out
    summary = json.loads((Path(out.strip().splitlines()[-1]) / "summary.json").read_text())
    assert "test_loss" not in summary and summary["test_loss_smoothed"] > 0 and "label_smoothing" in summary


def test_list_models_and_help(capsys):
    from zoo.train.cli import build_parser

    assert train.main(["--list-models"]) == 0
    listing = capsys.readouterr().out
    for name in zoo.list_models():
        params = zoo.model_info(zoo.create_model(name))["params"]
        assert any(line.split()[0] == name and f"{params:,}" in line for line in listing.splitlines()[1:])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "OUT/<model>/<run-id>/" in text and "--init-partial" in text
    parser_help = " ".join(text.split("options:")[1].split())  # argparse wraps the lines
    assert parser_help.count("(default: the model's recipe or --config, else") >= 20


def test_every_train_flag_has_help():
    from zoo.train.cli import build_parser

    assert [a.option_strings for a in build_parser()._actions if not a.help] == []


def test_eval_decodes_only_the_test_split_into_its_cache_dir(places, tmp_path, capsys):
    cache = tmp_path / "eval-cache"
    out = tmp_path / "eval"
    assert eval_cli.main(["--checkpoint", places["run"], "--out", str(out), "--cache-dir", str(cache),
                          "--max-test-images", "32", "--device", "cpu"]) == 0
    (cache_file,) = cache.glob("*.pt")
    decoded = torch.load(cache_file, weights_only=True)
    assert len(decoded["train_labels"]) == 0 and len(decoded["test_labels"]) == 32
    metrics = json.loads((out / "metrics.json").read_text())
    summary = json.loads((Path(places["run"]) / "summary.json").read_text())
    assert metrics["test_top1"] == pytest.approx(summary["test_top1"])  # normalised with the run's mean / std
    assert "test_loss" not in metrics and metrics["test_cross_entropy"] > 0
    assert "cross-entropy" in capsys.readouterr().out


def test_compare_labels_runs_that_share_a_run_id(places, tmp_path):
    first = tmp_path / "a" / "vit_nano" / "same-id"
    second = tmp_path / "b" / "vit_nano" / "same-id"
    for copy in (first, second):
        shutil.copytree(places["run"], copy)
    assert eval_cli.main(["--compare", str(first), str(second), "--out", str(tmp_path / "compare"),
                          "--deletion-images", "4", "--batch-size", "16", "--cache-dir", places["cache"]]) == 0
    labels = [line.split("|")[1].strip() for line in (tmp_path / "compare" / "compare.md").read_text().splitlines()
              if line.startswith("| vit_nano")]
    assert len(labels) == 2 and labels[0] != labels[1]
