"""Paths that name the wrong kind of thing: a ``--resume`` / ``--checkpoint`` file that is not a PyTorch
checkpoint, a ``--cache-dir`` that is a regular file, an ``eval.py --out`` inside a run directory (only the
run's own eval/ folder is allowed there). Each ends with one line on stderr and exit code 2, and the run
directory is left byte for byte as it was."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import train  # noqa: E402

_spec = importlib.util.spec_from_file_location("eval_cli", REPO / "eval.py")
eval_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_cli)


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def places(tiny_run, cifar_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad-paths")
    run = root / "runs" / "vit_nano" / tiny_run.name
    shutil.copytree(tiny_run, run)
    (root / "empty.ckpt").write_bytes(b"")
    (root / "notes.yaml").write_text("model: vit_nano\nlr: 0.1\n")
    (root / "FILE").write_text("not a folder\n")
    return {"run": str(run), "runs": str(root / "runs"), "csv": str(run / "metrics.csv"), "data": str(cifar_dir),
            "tmp": str(root), "cache": str(root / "cache")}


def fill(args: list[str], places: dict[str, str]) -> list[str]:
    return [a.format(**places) for a in args]


def assert_one_line(code: int, err: str, match: str) -> None:
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert re.search(match, err), (match, err)


CASES = [
    ("train: resume a CSV", train.main, ["--model", "vit_nano", "--resume", "{csv}"],
     r"metrics.csv is not a PyTorch checkpoint \(torch.save writes a zip archive; it starts with b'"),
    ("train: resume an empty file", train.main, ["--model", "vit_nano", "--resume", "{tmp}/empty.ckpt"],
     r"empty.ckpt is not a PyTorch checkpoint .*it is empty"),
    ("train: resume a YAML file", train.main, ["--model", "vit_nano", "--resume", "{tmp}/notes.yaml"],
     r"notes.yaml is not a PyTorch checkpoint"),
    ("train: init-from a CSV", train.main, ["--model", "vit_nano", "--data-dir", "{data}", "--init-from", "{csv}",
                                            "--max-train-images", "64", "--max-test-images", "16",
                                            "--set", "val_size=8"],
     r"metrics.csv is not a PyTorch checkpoint"),
    ("train: cache-dir a file", train.main, ["--model", "vit_nano", "--data-dir", "{data}", "--cache-dir",
                                             "{tmp}/FILE"], r"cache_dir .*FILE is a file, not a folder"),
    ("eval: checkpoint a CSV", eval_cli.main, ["--checkpoint", "{csv}", "--out", "{tmp}/e"],
     r"metrics.csv is not a PyTorch checkpoint"),
    ("eval: cache-dir a file", eval_cli.main, ["--checkpoint", "{run}", "--cache-dir", "{tmp}/FILE", "--out",
                                               "{tmp}/e"], r"cache_dir .*FILE is a file, not a folder"),
    ("eval: out the run", eval_cli.main, ["--checkpoint", "{run}", "--out", "{run}"],
     r"--out .* lies inside the run directory .*: write elsewhere, or into the run's own eval folder .*/eval$"),
    ("eval: out its checkpoints", eval_cli.main, ["--checkpoint", "{run}", "--out", "{run}/checkpoints"],
     r"--out .*/checkpoints lies inside the run directory"),
    ("eval: out below another folder of the run", eval_cli.main, ["--checkpoint", "{run}", "--out",
                                                                  "{run}/figures/a"], r"lies inside the run"),
    ("eval: compare into a run", eval_cli.main, ["--compare", "{run}", "--out", "{run}/compare"],
     r"lies inside the run directory"),
    ("eval: faithfulness into a run", eval_cli.main, ["--faithfulness", "{run}", "--out", "{run}"],
     r"lies inside the run directory"),
]


@pytest.mark.parametrize("what, main, args, match", CASES, ids=[c[0] for c in CASES])
def test_a_wrong_kind_of_path_is_one_line(what, main, args, match, places, tmp_path, capsys):
    before = snapshot(Path(places["runs"]))
    argv = fill(args, places)
    if main is train.main:
        argv += ["--out", str(tmp_path / "runs")] + ([] if "--cache-dir" in argv else ["--cache-dir", places["cache"]])
    code = main(argv)
    assert_one_line(code, capsys.readouterr().err.strip(), match)
    assert snapshot(Path(places["runs"])) == before
    assert not (tmp_path / "runs").exists() and not Path(places["tmp"], "e").exists()


def test_the_runs_own_eval_folder_is_allowed(places, capsys):
    out = Path(places["run"]) / "eval"
    code = eval_cli.main(["--checkpoint", places["run"], "--out", str(out), "--max-test-images", "16",
                          "--cache-dir", places["cache"], "--device", "cpu"])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert json.loads((out / "metrics.json").read_text())["num_images"] == 16
