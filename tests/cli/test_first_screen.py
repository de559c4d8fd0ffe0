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
from types import SimpleNamespace

import pytest

from zoo.train.forecast import RunForecast, format_duration, long_schedule_settings
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


def test_first_screen_says_size_plan_and_time_without_library_noise(image_tree, tmp_path):
    cmd = [sys.executable, "train.py", "--model", "vit_nano", "--data-dir", str(image_tree), "--epochs", "1",
           "--batch-size", "8", "--set", "val_size=16", "--precision", "32", "--limit-train-batches", "6",
           "--set", "ema_decay=0.9",  # the EMA callback: Lightning warns about it when best.ckpt is tested
           "--out", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    screen = done.stdout + done.stderr
    import zoo

    params = sum(p.numel() for p in zoo.create_model("vit_nano").parameters())
    assert f"vit_nano: {params / 1e6:.2f} M parameters" in done.stdout
    plan = re.search(r"^cpu \(.*\), precision 32-true, batch 8: 1 epochs x 6 steps = 6 steps; about (.+) \(([\d.]+) s "
                     r"a step, validation included\)$", done.stdout, re.M)
    assert plan, done.stdout
    assert "cpu_budget" not in screen  # a run of seconds gets no hint
    for noise in LIBRARY_NOISE:
        assert noise not in screen, noise
    assert "run left=" in done.stderr + done.stdout  # the progress bar shows the whole run's time left


def fake_run(recipe, steps_per_epoch: int, val_batches: int = 10, global_step: int = 4):
    trainer = SimpleNamespace(global_step=global_step, estimated_stepping_batches=recipe.epochs * steps_per_epoch,
                              num_training_batches=steps_per_epoch, accumulate_grad_batches=1,
                              num_val_batches=[val_batches], is_global_zero=True, progress_bar_callback=None,
                              precision="bf16-mixed")
    return trainer, SimpleNamespace(eval_passes=2)


def announce(recipe, step_time: float, budget_s=None, steps_per_epoch: int = 351):
    forecast = RunForecast(recipe, "cpu", "a test CPU", budget_s=budget_s)
    trainer, module = fake_run(recipe, steps_per_epoch)
    forecast._fit_t0 = __import__("time").perf_counter()
    forecast.step_time = step_time
    forecast._announce(trainer, module)
    return forecast, trainer, module


def test_a_long_cpu_run_names_the_cpu_sized_command_and_its_time_adds_up():
    recipe = resolve_config("vit_tiny", None, [], {"data_dir": "DATA"})
    forecast, trainer, module = announce(recipe, step_time=2.0)
    steps = recipe.epochs * 351
    # by hand: steps left x step time + one validation per epoch left (a third of a step per batch and TTA pass)
    expected = (steps - 4) * 2.0 + math.ceil((steps - 4) / 351) * (2.0 / 3 * 2 * 10)
    assert forecast.remaining_s(trainer, module) == pytest.approx(expected)
    plan, hint = forecast.lines
    assert f"{recipe.epochs} epochs x 351 steps = {steps:,} steps" in plan
    assert format_duration(expected).split()[0] in plan  # the hours
    assert hint.endswith("python train.py --model vit_tiny --data-dir DATA --config configs/cpu_budget.yaml "
                         "--max-time 00:00:10:00")


def test_a_budget_far_below_a_regularised_schedule_says_so_and_the_cpu_recipe_does_not():
    recipe = resolve_config("hybrid_tiny", None, [], {"max_time": "00:00:08:00"})
    assert long_schedule_settings(recipe)  # the model's own recipe regularises for 150 epochs
    forecast, _, _ = announce(recipe, step_time=1.0, budget_s=480.0)
    # by hand: (480 s - a validation of 2/3 * 2 passes * 10 batches) / (1 s + that / 351 steps) steps
    val = 1.0 / 3 * 2 * 10
    steps = int((480 - val) / (1.0 + val / 351)) + 4
    assert f"{steps:,} steps (about {steps / 351:.2g} of the recipe's 150 epochs" in forecast.lines[0]
    assert "add --config configs/cpu_budget.yaml" in forecast.lines[1]
    short = resolve_config("hybrid_tiny", str(REPO / "configs" / "cpu_budget.yaml"), [], {"max_time": "00:00:08:00"})
    assert long_schedule_settings(short) == []
    assert len(announce(short, step_time=1.0, budget_s=480.0)[0].lines) == 1


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
    waits = "print('first'); import time; time.sleep(60)"
    assert first_line_within(f"from zoo.train.console import line_buffered_output; line_buffered_output(); {waits}",
                             30) == "first"
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

    from zoo.train.data import cache
    from zoo.train.quiet import zoo_warnings_in_one_line

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # put back after the test
    zoo_warnings_in_one_line("eval.py")
    ours, theirs = inspect.getfile(cache), inspect.getfile(torch.nn.functional)
    assert warnings.formatwarning("rebuilt", UserWarning, ours, 111, "code") == "eval.py: warning: rebuilt\n"
    # Python's form: file:line: Category: message, then the source line indented
    assert warnings.formatwarning("old", FutureWarning, theirs, 7, "x") == f"{theirs}:7: FutureWarning: old\n  x\n"
