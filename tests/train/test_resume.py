"""Runs of train.py: SIGKILL of a subprocess mid-training then ``--resume auto`` continues the same run
directory from checkpoints/last.ckpt; a finished run's resume keeps its results; DDP on two CPU processes (gloo)
leaves one run directory."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def base_args(cifar_dir, tmp_path):
    return [sys.executable, str(REPO / "train.py"), "--model", "vit_nano",
            "--data-dir", str(cifar_dir), "--cache-dir", str(tmp_path / "cache"), "--max-train-images", "400",
            "--max-test-images", "64", "--set", "val_size=64", "--batch-size", "16",
            "--out", str(tmp_path / "runs"), "--limit-val-batches", "1", "--limit-test-batches", "1",
            # a one-block, 32-wide vit_nano in fp32 (no precision probe): what is tested is the run's files
            "--precision", "32", "--set", "model_args.embed_dim=32", "--set", "model_args.depth=1"]


def test_sigkill_then_resume_auto_continues_the_same_run(base_args, tmp_path, run_train):
    cmd = [*base_args, "--epochs", "2", "--limit-train-batches", "20", "--ckpt-every-n-steps", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    deadline = time.time() + 180
    last = None
    while time.time() < deadline and proc.poll() is None:
        found = list((tmp_path / "runs").glob("vit_nano/*/checkpoints/last.ckpt"))
        if found:
            last = found[0]
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert last is not None, "no checkpoint appeared before the run ended"
    run_dir = last.parent.parent
    assert not (run_dir / "summary.json").exists(), "the run finished before it could be killed"
    killed_at = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    assert 0 < killed_at < 40

    done = run_train([*cmd[2:], "--resume", "auto"], cwd=tmp_path)  # the resume need not be a new process
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str(run_dir)
    assert [p.name for p in (tmp_path / "runs" / "vit_nano").iterdir()] == [run_dir.name]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 40 and summary["epochs"] == 2
    with open(run_dir / "metrics.csv", newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f)]
    assert steps == sorted(steps) and steps[-1] >= 39      # history before the kill kept, not duplicated
    assert min(steps) <= killed_at  # a row of the steps before the kill (at most the checkpoint's own step)


def test_a_resume_of_a_finished_run_keeps_its_results(base_args, tmp_path, run_train):
    """Fewer --epochs than the run has trained: Lightning refuses that only once training starts, after the run's
    config.yaml was rewritten; train.py refuses it first, in one line naming the flag. As many: nothing to train,
    and the run's summary.json stays as the run wrote it."""
    cmd = [*base_args[2:], "--limit-train-batches", "1"]  # in this process: what is tested is the run's files
    first = run_train([*cmd, "--epochs", "2"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = Path(first.stdout.strip().splitlines()[-1])
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    done = run_train([*cmd, "--epochs", "1", "--resume", str(run_dir)], cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].endswith("past --epochs 1; resume with --epochs 2 or more (its "
                                                          "config.yaml), or start a new run"), done.stderr
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before
    summary = (run_dir / "summary.json").read_bytes()
    again = run_train([*cmd, "--epochs", "2", "--resume", "auto"], cwd=tmp_path)  # finished: nothing to train
    assert again.returncode == 0 and "the run had finished" in again.stdout, again.stderr[-3000:]
    assert (run_dir / "summary.json").read_bytes() == summary  # its test numbers kept, not a 0-step rerun's
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["resume"] is None  # the recipe, not the action


@pytest.mark.slow  # the default suite's real DDP run: test_distributed's torchrun run, which also resumes
@pytest.mark.parametrize("compile", [[], ["--compile", "step"]])
def test_ddp_two_cpu_processes_leave_one_run(base_args, tmp_path, compile):
    cmd = [*base_args, "--epochs", "1", "--limit-train-batches", "2", "--accelerator", "cpu",
           "--devices", "2", "--strategy", "ddp", *compile]  # compile step: each rank compiles its training step
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "ZOO_RUN_DIR")}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "runs" / "vit_nano").iterdir())
    assert len(runs) == 1
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["devices"] == 2 and summary["global_step"] == 2
    assert (runs[0] / "checkpoints" / "last.ckpt").is_file()
    assert "sync_dist=True" not in done.stderr  # rank 0's loss and clock are logged on purpose: no advice shown


def tiny_run_argv(run: Path, cifar_dir, out: Path, cache: Path, *extra) -> list[str]:
    """The arguments that trained conftest's ``tiny_run``, resuming ``run`` under ``out``."""
    return ["--model", "vit_nano", "--data-dir", str(cifar_dir), "--epochs", "1", "--max-train-images", "128",
            "--max-test-images", "32", "--limit-train-batches", "2", "--limit-val-batches", "1", "--batch-size", "32",
            "--set", "val_size=32", "--out", str(out), "--cache-dir", str(cache), "--resume", str(run), *extra]


def _files(run: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_resume_with_another_recipe_is_refused_before_the_data_is_read(tiny_run, cifar_dir, tmp_path, capsys):
    """--lr, --batch-size or --set label_smoothing=... on a resume would train on with values the run's config.yaml
    does not record: refused in one line naming each (exit 2), the run left byte for byte, no image decoded."""
    from zoo.train import cli

    run = tmp_path / "runs" / "vit_nano" / tiny_run.name
    shutil.copytree(tiny_run, run)
    before = _files(run)
    cache = tmp_path / "cache"
    code = cli.main(tiny_run_argv(run, cifar_dir, tmp_path / "runs", cache, "--epochs", "2", "--lr", "0.002",
                                  "--batch-size", "16", "--set", "label_smoothing=0.2"))
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "differs from the run's config.yaml" in err[0], err
    for named in ("lr: 0.001 in the run, 0.002 now", "batch_size: 32 in the run, 16 now",
                  "label_smoothing: 0.1 in the run, 0.2 now"):
        assert named in err[0]
    assert "epochs" not in err[0].split("(", 1)[1]  # a longer run is a resume's own change
    assert _files(run) == before and not cache.exists()


def test_what_a_resume_may_change_passes_the_recipe_check(tiny_run):
    """The run's own recipe with the settings a resume may change (longer, elsewhere, other output, auto choices)
    passes; one training setting more does not."""
    from dataclasses import replace

    from zoo.train.recipe import Recipe
    from zoo.train.runs import check_resume_recipe

    recorded = Recipe.from_yaml(tiny_run / "config.yaml")
    moved = replace(recorded, epochs=9, max_time="00:00:10:00", devices=1, accelerator="cpu", data_dir="/elsewhere",
                    cache_dir="/tmp/x", out="/tmp/y", loggers=["tensorboard"], ckpt_every_n_steps=7,
                    ckpt_every_minutes=0.0, resume=str(tiny_run), precision="auto", muon_dtype="auto",
                    eval_batch_size=8, data_memory_budget=0.5)
    check_resume_recipe(moved, tiny_run)
    with pytest.raises(ValueError, match=r"seed: 0 in the run, 1 now"):
        check_resume_recipe(replace(moved, seed=1), tiny_run)
    with pytest.raises(ValueError, match=r"augment.cutout: 0 in the run, 4 now"):
        check_resume_recipe(replace(moved, augment=replace(moved.augment, cutout=4)), tiny_run)


def test_a_resume_on_a_read_only_mount_is_one_line(tiny_run, cifar_dir, tmp_path, capsys, monkeypatch):
    """The run lock cannot be opened where the run directory is read-only ([Errno 30]): one line naming the fix."""
    import builtins
    import errno

    from zoo.train import cli, runs

    def read_only(path, *args, **kwargs):
        if str(path).endswith(runs.LOCK_FILE):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(runs, "open", read_only, raising=False)
    run = tmp_path / "runs" / "vit_nano" / tiny_run.name
    shutil.copytree(tiny_run, run)
    before = _files(run)
    assert cli.main(tiny_run_argv(run, cifar_dir, tmp_path / "runs", tmp_path / "cache", "--epochs", "2")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Read-only file system" in err[0] and "writable" in err[0], err
    assert _files(run) == before
