"""The main command's first screen is the zoo's: the model's size, then one line with the device, precision,
epochs, steps and the estimated wall time, a hint toward the CPU-sized recipe where a run would be long, no
library chatter, and output that goes out line by line also into a pipe."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from zoo.train.clock import RunClock
from zoo.train.progress import format_duration, long_schedule_settings, plan_lines
from zoo.train.recipe import resolve_config

REPO = Path(__file__).resolve().parents[2]

# what the libraries print on a run's first screen without the zoo's filters (tried on Lightning 2.6)
LIBRARY_NOISE = ("💡 Tip", "GPU available:", "TPU available:", "Automatic Mixed Precision", "LeafSpec",
                 "not supported by the model summary", "Total Flops", "| Name", "estimate number of stepping",
                 "smaller than the logging interval", "callbacks used to create the checkpoint")


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory, image_tree_writer):
    """train/ and test/ ImageFolder trees of random 32 x 32 PNGs, 10 classes."""
    return image_tree_writer(tmp_path_factory.mktemp("tree"), 32)


PLAN_LINE = (r"^cpu \(.*\), precision 32-true, optimizer (\w+), batch 8: (\d+) epochs x (\d+) steps = ([\d,]+) steps"
             r"(, ([\d,]+) done)?; about (.+) in all \((.+) training and validation, (.+) the test of ([\d,]+) images "
             r"x (\d+) pass(es)?; ([\d.]+) s a step, timed before training\)$")
TRAINING_BAR = re.compile(r"Epoch (\d+): +\d+%\|[^|]*\| *(\d+)/(\S+) steps")
# warnings of the libraries: Python's form (file:line: Category: message), torch's logging form (W1205 12:00:00 ...)
LIBRARY_WARNING = re.compile(r"(site-packages|Warning: |^[WE]\d{4} \d\d:\d\d:\d\d|weights_only|current_model_state|"
                             r"Restoring states|CUDA_HOME)", re.M)


def train_screen(args, tmp_path, env=None):
    """train.py's whole output with ``args`` (and its runs under tmp_path / runs), its lines in the order written to
    stdout (tqdm's redraws split at each carriage return), and the process."""
    cmd = [sys.executable, "train.py", *args, "--out", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [part.strip() for line in done.stdout.splitlines() for part in line.split("\r") if part.strip()]
    return done.stdout + done.stderr, lines


def assert_quiet(screen: str) -> None:
    for noise in LIBRARY_NOISE:
        assert noise not in screen, noise
    assert not LIBRARY_WARNING.search(screen), LIBRARY_WARNING.search(screen).group(0)


def plan_before_training(lines: list[str]) -> tuple[re.Match, list[tuple[int, int, str]]]:
    """The plan line (it comes before any training step was counted on the bar) and the training bar's
    (epoch, count, total) as drawn."""
    plans = [i for i, line in enumerate(lines) if re.match(PLAN_LINE, line)]
    assert len(plans) == 1, lines
    assert lines[0].startswith("vit_nano: reading the images of ")  # the run's first line, before the data
    bars = [(i, TRAINING_BAR.search(line)) for i, line in enumerate(lines)]
    drawn = [(i, int(m[1]), int(m[2]), m[3]) for i, m in bars if m]
    stepped = [i for i, _, count, _ in drawn if count > 0]
    assert stepped and plans[0] < stepped[0], lines  # the estimate before the first step
    first_bar = min(i for i, *_ in drawn)
    assert plans[0] < first_bar, lines  # above the bar: not a redraw of it
    return re.match(PLAN_LINE, lines[plans[0]]), [(epoch, count, total) for _, epoch, count, total in drawn]


def test_first_screen_says_size_plan_and_time_without_library_noise(image_tree, tmp_path):
    args = ["--model", "vit_nano", "--data-dir", str(image_tree), "--epochs", "1", "--batch-size", "8", "--set",
            "val_size=16", "--precision", "32", "--limit-train-batches", "6",
            "--set", "ema_decay=0.9"]  # the EMA callback: Lightning warns about it when best.ckpt is tested
    screen, lines = train_screen(args, tmp_path, env={"CUDA_HOME": str(tmp_path)})  # torch's notice, on a CPU
    import zoo

    params = sum(p.numel() for p in zoo.create_model("vit_nano").parameters())
    assert f"vit_nano: {params / 1e6:.2f} M parameters" in screen
    plan, bar = plan_before_training(lines)
    assert plan.group(1, 2, 3, 4) == ("adamw", "1", "6", "6")
    assert plan.group(10) == "20"  # the tree's test images: 2 of each of 10 classes
    assert "cpu_budget" not in screen  # a run of seconds gets no hint
    assert_quiet(screen)
    assert {total for _, _, total in bar} == {"6"} and bar[-1][1] == 6  # the run's 6 steps, never an epoch's
    assert "0/?" not in screen  # every bar is drawn first with its total
    assert "run left=" in screen  # the progress bar shows the whole run's time left


@pytest.mark.slow  # two subprocess runs; the default suite keeps the main command's first screen and the bar's tests
def test_the_cpu_recipe_and_its_resume_show_the_runs_steps_without_library_noise(image_tree, tmp_path):
    """The README's CPU command on a tiny subset (compilation off: seconds, not minutes), then --resume auto with
    more epochs: one plan line before the first step, the bar's total the run's steps (and after the resume, from
    the step it resumed at), no warning of torch, Lightning or timm on either screen."""
    args = ["--model", "vit_nano", "--config", "configs/cpu_budget.yaml", "--data-dir", str(image_tree),
            "--batch-size", "8", "--set", "val_size=16", "--limit-train-batches", "3", "--set", "compile=false",
            "--set", "tta=0"]
    env = {"CUDA_HOME": str(tmp_path)}
    screen, lines = train_screen([*args, "--epochs", "1"], tmp_path, env)
    plan, bar = plan_before_training(lines)
    assert plan.group(2, 3, 4) == ("1", "3", "3") and plan.group(6) is None
    assert plan.group(10, 11) == ("20", "1")  # tta 0: one pass over the tree's 20 test images
    assert {total for _, _, total in bar} == {"3"} and bar[-1][1] == 3
    assert_quiet(screen)

    screen, lines = train_screen([*args, "--epochs", "3", "--resume", "auto"], tmp_path, env)
    plan, bar = plan_before_training(lines)
    assert plan.group(2, 3, 4, 6) == ("3", "3", "9", "3")  # 3 epochs of 3 steps, 3 of them done
    assert {total for _, _, total in bar} == {"9"}, bar  # the run's total kept after the resume
    assert bar[0][1] == 3 and bar[-1][1] == 9  # from the step it resumed at to the last
    assert [epoch for epoch, count, _ in bar if count == 4][0] == 1
    assert "0/?" not in screen
    assert_quiet(screen)


def test_torchs_cuda_notice_on_a_cpu_is_filtered_and_other_warnings_are_not():
    """torch.utils.cpp_extension warns at import (inductor imports it to compile) when CUDA_HOME names a folder and
    no CUDA runtime is there; the zoo drops that one message, by its logger, and nothing else of torch's."""
    code = ("import logging, sys; {quiet}import torch.utils.cpp_extension; "
            "logging.getLogger('torch.utils.cpp_extension').warning('another warning')")
    env = {**os.environ, "CUDA_HOME": str(REPO)}
    plain = subprocess.run([sys.executable, "-c", code.format(quiet="")], cwd=REPO, capture_output=True, text=True,
                           env=env, timeout=120)
    assert "No CUDA runtime is found" in plain.stderr  # what a CPU user saw
    quiet = "from zoo.runtime.console import quiet_libraries; quiet_libraries(); "
    filtered = subprocess.run([sys.executable, "-c", code.format(quiet=quiet)], cwd=REPO, capture_output=True,
                              text=True, env=env, timeout=120)
    assert "No CUDA runtime is found" not in filtered.stderr and "another warning" in filtered.stderr


def announce(recipe, step_time: float, budget_s=None, steps_per_epoch: int = 351, done: int = 4):
    """The plan lines of a run ``done`` steps in, 351 steps an epoch, 10 validation batches of two TTA passes each,
    a step timed at ``step_time`` s before training; and its clock."""
    timed = RunClock(budget_s=budget_s, scheduled_steps=recipe.epochs * steps_per_epoch,
                     steps_per_epoch=steps_per_epoch, val_batches=10, eval_passes=2, step_s=step_time)
    lines = plan_lines(recipe, accelerator="cpu", machine="a test CPU", precision="bf16-mixed",
                       steps=timed.run_steps(done), done=done, steps_per_epoch=steps_per_epoch, budget_s=budget_s,
                       train_s=timed.remaining_s(done), test_s=0.0, test_images=0, eval_passes=2,
                       step_seconds=f"{step_time} s a step", timed_before=True)
    return timed, lines


def test_a_long_cpu_run_names_the_cpu_sized_command_and_its_time_adds_up():
    recipe = resolve_config("vit_tiny", None, [], {"data_dir": "DATA"})
    timed, (plan, hint) = announce(recipe, step_time=2.0)
    steps = recipe.epochs * 351
    # by hand: steps left x step time + one validation per epoch left (a third of a step per batch and TTA pass)
    expected = (steps - 4) * 2.0 + math.ceil((steps - 4) / 351) * (2.0 / 3 * 2 * 10)
    assert timed.remaining_s(4) == pytest.approx(expected)
    assert f"{recipe.epochs} epochs x 351 steps = {steps:,} steps" in plan
    assert format_duration(expected).split()[0] in plan  # the hours
    assert hint.endswith("python train.py --model vit_tiny --data-dir DATA --config configs/cpu_budget.yaml "
                         "--max-time 00:00:10:00")


def test_a_budget_far_below_a_regularised_schedule_says_so_and_the_cpu_recipe_does_not():
    recipe = resolve_config("hybrid_tiny", None, [], {"max_time": "00:00:08:00"})
    assert long_schedule_settings(recipe)  # the model's own recipe regularises for 150 epochs
    _, lines = announce(recipe, step_time=1.0, budget_s=480.0)
    # by hand: (480 s - a validation of 2/3 * 2 passes * 10 batches) / (1 s + that / 351 steps) steps
    val = 1.0 / 3 * 2 * 10
    steps = int((480 - val) / (1.0 + val / 351)) + 4
    assert f"{steps:,} steps (about {steps / 351:.2g} of the recipe's 150 epochs" in lines[0]
    assert "add --config configs/cpu_budget.yaml" in lines[1]
    short = resolve_config("hybrid_tiny", str(REPO / "configs" / "cpu_budget.yaml"), [], {"max_time": "00:00:08:00"})
    assert long_schedule_settings(short) == []
    assert len(announce(short, step_time=1.0, budget_s=480.0)[1]) == 1


def test_the_bar_counts_the_steps_a_budget_buys_and_a_resumed_runs_fitted_schedule():
    """With --max-time the bar's total is the steps the budget buys: before the budget is fitted to measured steps,
    from the probe's step time by the budget's own formula (worked by hand here); once fitted, or restored from a
    resumed run's checkpoint, the fitted step count."""
    recipe = resolve_config("vit_tiny", None, [], {"max_time": "00:00:10:00"})
    timed, _ = announce(recipe, step_time=2.0, budget_s=600.0)
    val = 2.0 / 3 * 2 * 10  # a validation pass: a third of a step per batch and TTA pass, 10 batches
    assert timed.run_steps(4) == 4 + int((600 - val) / (2.0 + val / 351))
    timed.load_state_dict({**timed.state_dict(), "step_time": 1.5, "val_time": 3.0, "total_steps": 123,
                           "elapsed": 100.0})
    assert timed.run_steps(4) == 123


def first_line_within(code: str, seconds: float) -> str | None:
    """The first line a Python process writes into a pipe while it still runs, or None after ``seconds``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a user's shell has it
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    line = got[0].strip() if got else None  # read before the kill, whose end of file would read as ''
    proc.kill()
    proc.wait()
    return line or None


def test_output_into_a_pipe_goes_out_line_by_line():
    # the process sleeps far longer than the wait, so "first" can only arrive by line buffering; the wait covers
    # importing torch and timm on a slow or busy CPU (14 s on a quiet Zen 1, over 30 s under load)
    waits = "print('first'); import time; time.sleep(600)"
    assert first_line_within(f"from zoo.runtime.console import line_buffered_output; line_buffered_output(); {waits}",
                             180) == "first"
    assert first_line_within(waits, 2) is None  # Python's own block buffer: what the CLIs change


@pytest.mark.slow
def test_the_readme_main_command_on_a_cpu_names_its_time_and_the_cpu_sized_command(cifar_dir, tmp_path):
    """``python train.py --model vit_tiny --data-dir DIR`` (200 epochs): the plan line and the hint come before
    training goes on; the run is stopped there."""
    cmd = [sys.executable, "train.py", "--model", "vit_tiny", "--data-dir", str(cifar_dir), "--accelerator", "cpu",
           "--out", str(tmp_path / "runs")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # the CLI's own line buffering
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if "cpu_budget" in line:
                break
    finally:
        proc.kill()
        proc.wait()
    assert any(re.match(r"cpu \(.*\), precision .*: 200 epochs x \d+ steps = [\d,]+ steps; about \d+ h", line)
               for line in lines), lines
    assert lines[-1].endswith(f"--data-dir {cifar_dir} --config configs/cpu_budget.yaml --max-time 00:00:10:00")


def test_the_zoos_warnings_are_one_line_and_the_libraries_keep_pythons_form(monkeypatch):
    import inspect
    import warnings

    import torch.nn.functional

    from zoo.data import cache
    from zoo.runtime.console import zoo_warnings_in_one_line

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # put back after the test
    zoo_warnings_in_one_line("eval.py")
    ours, theirs = inspect.getfile(cache), inspect.getfile(torch.nn.functional)
    assert warnings.formatwarning("rebuilt", UserWarning, ours, 111, "code") == "eval.py: warning: rebuilt\n"
    # Python's form: file:line: Category: message, then the source line indented
    assert warnings.formatwarning("old", FutureWarning, theirs, 7, "x") == f"{theirs}:7: FutureWarning: old\n  x\n"
