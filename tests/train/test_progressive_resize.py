"""Progressive resizing (``low_res_size`` / ``low_res_until``): which training steps see smaller images, what those
images are (PIL's antialiased bilinear resize is the reference), what a teacher sees, where the switch stays when
the schedule is refitted or the run resumed, and the time budget's step count for two step costs (a step-by-step
simulation of the run is the reference), measured on a scripted clock."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from PIL import Image

from zoo.train import clock, loop
from zoo.train.clock import RunClock, total_steps_in_budget
from zoo.train.progress import plan_lines, step_seconds_text
from zoo.train.recipe import resolve_config

TINY = ["--set", "model_args.embed_dim=32", "--set", "model_args.depth=1", "--set", "model_args.num_heads=2",
        "--set", "model_args.dynamic_img_size=true"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory, image_tree_writer):
    """16 x 16 images: 32 per class in train (320), 1 per class in test."""
    return image_tree_writer(tmp_path_factory.mktemp("tree"), 16, counts=(("train", 32), ("test", 1)))


def argv(tree, tmp_path, *extra, low_res: bool = True) -> list:
    resizing = ["--set", "low_res_size=8", "--set", "low_res_until=0.5"] if low_res else []
    return ["--model", "vit_nano", "--data-dir", tree, "--img-size", "16", "--batch-size", "8", "--precision", "32",
            "--set", "val_size=8", *resizing, "--set", "augment.crop_padding=0", "--set", "augment.hflip=false",
            "--ckpt-every-minutes", "0", "--out", tmp_path / "runs", "--cache-dir", tmp_path / "cache", *TINY,
            *extra]


class Watch:
    """The shapes of the images each training forward of the model sees (and, with ``cost``, a scripted clock
    moved on by ``cost(images)`` seconds at each training forward); the run, when training ends."""

    def __init__(self, cost=None, at_step=None):
        self.train_shapes, self.cost, self.at_step, self.run, self.now = [], cost, at_step or {}, None, 0.0

    def on_train_start(self, run):
        def seen(module, args):
            if module.training:
                self.train_shapes.append(tuple(args[0].shape[-2:]))
                if self.cost is not None:
                    self.now += self.cost(args[0])
        run.net.register_forward_pre_hook(seen)

    def on_train_batch_end(self, run):
        if run.position.step in self.at_step:
            self.at_step[run.position.step](run)

    def on_train_end(self, run):
        self.run, self.ended_at = run, self.now


def train(run_train, monkeypatch, args, watch: Watch) -> None:
    monkeypatch.setattr(loop, "fit", functools.partial(loop.fit, callbacks=[watch]))
    done = run_train(args)
    assert done.returncode == 0, done.stderr[-2000:]


def pil_resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """Each channel through PIL's bilinear resize (antialiased when it shrinks), in float32."""
    return torch.stack([torch.stack([torch.from_numpy(np.array(
        Image.fromarray(channel.numpy(), mode="F").resize((size, size), Image.BILINEAR))) for channel in image])
        for image in images])


def test_steps_before_the_switch_train_on_resized_images(run_train, tree, tmp_path, monkeypatch):
    resized = []
    real = loop.low_res
    monkeypatch.setattr(loop, "low_res", lambda images, size: resized.append((images, real(images, size))) or
                        resized[-1][1])
    watch = Watch()
    train(run_train, monkeypatch, argv(tree, tmp_path, "--epochs", "1", "--limit-train-batches", "8"), watch)
    assert watch.run.position.low_res_steps == 4  # half of the 8 steps
    assert watch.train_shapes == [(8, 8)] * 4 + [(16, 16)] * 4
    assert len(resized) == 4
    for full, small in resized:
        torch.testing.assert_close(small, pil_resize(full, 8), atol=1e-5, rtol=0)


def test_validation_and_the_teacher_see_full_size_images(run_train, tree, tmp_path, monkeypatch):
    teacher = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 10)).eval().requires_grad_(False)
    taught = []
    teacher.register_forward_pre_hook(lambda m, args: taught.append(tuple(args[0].shape[-2:])))
    monkeypatch.setattr(loop, "load_teacher", lambda spec, classes, size: teacher)
    watch, evaluated = Watch(), []

    def look(run):
        run.net.register_forward_pre_hook(lambda m, args: None if m.training else evaluated.append(
            tuple(args[0].shape[-2:])))

    watch.at_step = {1: look}
    train(run_train, monkeypatch, argv(tree, tmp_path, "--epochs", "1", "--limit-train-batches", "2",
                                        "--limit-val-batches", "1", "--limit-test-batches", "1", "--set",
                                        "teacher=a-teacher", "--set", "low_res_until=1.0"), watch)
    assert taught == [(16, 16)] * 2 and watch.train_shapes == [(8, 8)] * 2
    assert evaluated and set(evaluated) == {(16, 16)}  # the validation and the test


def test_the_switch_moves_with_a_refit_until_it_is_reached(run_train, tree, tmp_path, monkeypatch):
    # 12 steps: the switch at 6 until the refits; 8 steps moves it to 4; past it, a longer schedule leaves it there
    watch = Watch(at_step={2: lambda run: loop.refit(run, 8), 5: lambda run: loop.refit(run, 100)})
    train(run_train, monkeypatch, argv(tree, tmp_path, "--epochs", "1", "--limit-train-batches", "12"), watch)
    assert watch.run.position.low_res_steps == 4
    assert watch.train_shapes == [(8, 8)] * 4 + [(16, 16)] * 8


def test_a_resumed_run_keeps_its_switch(run_train, tree, tmp_path, monkeypatch):
    first = argv(tree, tmp_path, "--limit-train-batches", "4")
    train(run_train, monkeypatch, [*first, "--epochs", "1"], Watch())
    (run_dir,) = (tmp_path / "runs" / "vit_nano").iterdir()
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["loop"]["low_res_steps"] == 2
    watch = Watch()
    train(run_train, monkeypatch, [*first, "--epochs", "3", "--resume", "auto"], watch)
    assert watch.run.position.low_res_steps == 2  # not half of the new 12 steps
    assert watch.train_shapes == [(16, 16)] * 8


def test_a_model_that_cannot_take_the_size_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"low_res_size 8: vit_nano does not take 8x8 images \(a ViT takes it with "
                                         r"model_args.dynamic_img_size: true\)"):
        resolve_config("vit_nano", overrides=["low_res_size=8", "img_size=16"])
    with pytest.raises(ValueError, match="low_res_size 6: .* must be divisible by patch_size"):
        resolve_config("vit_nano", overrides=["low_res_size=6", "img_size=16", "model_args.dynamic_img_size=true"])
    with pytest.raises(ValueError, match="low_res_size 16: hybrid_tiny does not take 16x16 images: expected"):
        resolve_config("hybrid_tiny", overrides=["low_res_size=16"])
    with pytest.raises(ValueError, match=r"low_res_size must be below img_size \(32\), got 32"):
        resolve_config("vit_tiny", overrides=["low_res_size=32", "model_args.dynamic_img_size=true"])
    assert resolve_config("resnet18_cbam", overrides=["low_res_size=16"]).low_res_size == 16  # a CNN takes any size


def simulated_total(done, left, val, per_epoch, low, full, share) -> int:
    """The largest total T whose remaining steps (those before share * T at ``low`` seconds, the rest at ``full``),
    one validation per ``per_epoch`` steps and the final validation fit in ``left`` seconds, step by step."""
    best = done + 1
    for total in range(done + 1, 10 * done + 2_000):  # the budget buys far fewer steps than this
        switch = share * total
        spent = sum(low if step < switch else full for step in range(done, total))
        if spent + val + (total - done) * val / per_epoch <= left:
            best = total
    return best


@pytest.mark.parametrize("done, share", [(25, 0.9), (25, 0.75), (0, 0.5), (300, 0.75), (10, 1.0), (40, 0.0)])
def test_the_budget_counts_full_size_steps_at_their_cost(done, share):
    left, val, per_epoch, low, full = 60.0, 3.0, 100, 0.05, 0.2
    fitted = total_steps_in_budget(done, left, val, per_epoch, low, full, share)
    assert abs(fitted - simulated_total(done, left, val, per_epoch, low, full, share)) <= 1


def scripted_clock(monkeypatch, watch: Watch) -> None:
    """The run's clock reads the watch's time, which only training forwards move on; the timings start after one
    step and measure four (the run is short)."""
    monkeypatch.setattr(clock, "now", lambda: watch.now)
    monkeypatch.setattr(RunClock, "SKIP", 1)
    monkeypatch.setattr(RunClock, "MEASURE", 4)
    monkeypatch.setattr(loop, "probe_step_seconds", lambda *args: 0.04)


def test_the_budget_fits_and_keeps_two_step_costs(run_train, tree, tmp_path, monkeypatch):
    """A run of 3 (scripted) seconds whose full-size steps cost 0.04 s and low-res ones 0.01 s: the budget fits the
    switch and the step count from the low-res time and the pixel ratio, measures the full-size steps after the
    switch, and stops inside the budget after the steps its formula gives."""
    watch = Watch(cost=lambda images: 0.01 / 64 * images[0, 0].numel())
    scripted_clock(monkeypatch, watch)
    train(run_train, monkeypatch, argv(tree, tmp_path, "--epochs", "100", "--limit-val-batches", "0",
                                        "--max-time", "00:00:00:03"), watch)
    run = watch.run
    assert run.clock.step_time == pytest.approx(0.01) and run.clock.full_step_time == pytest.approx(0.04)
    switch = run.position.low_res_steps
    shapes = watch.train_shapes
    assert shapes == [(8, 8)] * switch + [(16, 16)] * (len(shapes) - switch)
    assert len(shapes) == run.clock.total_steps == simulated_total(0, 3.0, 0.0, 40, 0.01, 0.04, 0.5)
    assert watch.ended_at <= 3.0 + 1e-9


def test_a_busy_start_does_not_cut_the_run_short(run_train, tree, tmp_path, monkeypatch):
    """The machine is 4 times slower while the first 40 steps run (the first step time is measured then), then
    normal: the windows of ``REFIT_EVERY`` steps measure the real step time again, and the run ends inside its
    budget with less than two windows' worth of steps unspent (the first measurement alone would have stopped
    it after about a third of the budget)."""
    steps = []
    watch = Watch(cost=lambda images: steps.append(1) or (0.04 if len(steps) <= 40 else 0.01))
    scripted_clock(monkeypatch, watch)
    train(run_train, monkeypatch, argv(tree, tmp_path, "--epochs", "100", "--limit-val-batches", "0", "--max-time",
                                        "00:00:00:06", low_res=False), watch)
    assert watch.run.clock.step_time == pytest.approx(0.01)
    assert 6.0 - 2 * RunClock.REFIT_EVERY * 0.01 <= watch.ended_at <= 6.0 + 1e-9


def test_the_time_left_counts_full_size_steps_at_their_cost():
    """An epoch-scheduled run whose step time was measured on 16 x 16 images: by hand, the steps before the switch
    at that time, those after at 4 times it (32 x 32), one full-size validation per epoch left."""
    recipe = resolve_config("vit_tiny", overrides=["low_res_size=16", "model_args.dynamic_img_size=true"])
    total = recipe.epochs * 351
    switch = int(recipe.low_res_until * total)
    timed = RunClock(budget_s=None, scheduled_steps=total, steps_per_epoch=351, val_batches=10, low_res_cost=4.0,
                     low_res_until=recipe.low_res_until)
    timed.step_time, timed.timed_low = 0.5, True  # measured before the switch
    expected = (switch - 4) * 0.5 + (total - switch) * 2.0 + math.ceil((total - 4) / 351) * (2.0 / 3 * 10)
    assert timed.remaining_s(4, switch) == pytest.approx(expected)
    assert step_seconds_text(timed.step_times(), 16, 32) == "0.5 s a step at 16x16, 2 s at 32x32"


def test_the_plan_line_counts_the_steps_a_budget_buys_at_two_step_costs():
    """Under --max-time, before the budget is fitted to measured steps: from the probe's full-size step (2 s), a
    16 x 16 step costs a quarter, and the steps are those of the step-by-step simulation."""
    recipe = resolve_config("vit_tiny", overrides=["low_res_size=16", "model_args.dynamic_img_size=true",
                                                   "max_time=00:00:10:00"])
    total = recipe.epochs * 351
    timed = RunClock(budget_s=600.0, scheduled_steps=total, steps_per_epoch=351, val_batches=10, low_res_cost=4.0,
                     low_res_until=recipe.low_res_until, step_s=2.0)
    timed.start(0)
    val = 2.0 / 3 * 10  # a full-size validation: a third of a step per batch
    steps = timed.fit_steps(0, round(total * recipe.low_res_until))
    assert abs(steps - simulated_total(0, 600.0, val, 351, 0.5, 2.0, recipe.low_res_until)) <= 1
    line, *_ = plan_lines(recipe, accelerator="cpu", machine="a CPU", precision="32-true", steps=steps, done=0,
                         steps_per_epoch=351, budget_s=600.0, train_s=timed.remaining_s(0) or 0.0, test_s=1.0,
                         test_images=100, eval_passes=1, step_seconds=step_seconds_text(timed.step_times(), 16, 32),
                         timed_before=True)
    assert "0.5 s a step at 16x16, 2 s at 32x32, timed before training" in line
