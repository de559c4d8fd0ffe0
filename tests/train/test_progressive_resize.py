"""Progressive resizing (``low_res_size`` / ``low_res_until``): which training steps see smaller images, what those
images are (PIL's antialiased bilinear resize is the reference), what a teacher sees, where the switch stays when
the schedule is refitted or the run resumed, and the time budget's step count for two step costs (a step-by-step
simulation of the run is the reference)."""

from __future__ import annotations

import math
import time

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from zoo.train.callbacks import TimeBudget
from zoo.train.forecast import total_steps_in_budget
from zoo.train.module import ImageClassifier
from zoo.train.recipe import resolve_config

TINY = {"embed_dim": 32, "depth": 1, "num_heads": 2, "img_size": 16, "dynamic_img_size": True}


class Batches(pl.LightningDataModule):
    """``n`` random 16 x 16 images with random labels, in order (batch k is images[k * batch_size:])."""

    def __init__(self, n: int = 64, batch_size: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.images, self.labels = torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)
        self.batch_size = batch_size

    def _loader(self):
        return DataLoader(TensorDataset(self.images, self.labels), batch_size=self.batch_size)

    train_dataloader = val_dataloader = _loader


def trainer(tmp_path, **kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                      num_sanity_val_steps=0, **kwargs)


def module(**kwargs) -> ImageClassifier:
    return ImageClassifier("vit_nano", TINY, num_classes=10, **{"low_res_size": 8, "low_res_until": 0.5, **kwargs})


def record_inputs(model: torch.nn.Module) -> list[torch.Tensor]:
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    return seen


def pil_resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """Each channel through PIL's bilinear resize (antialiased when it shrinks), in float32."""
    return torch.stack([torch.stack([torch.from_numpy(np.array(
        Image.fromarray(channel.numpy(), mode="F").resize((size, size), Image.BILINEAR))) for channel in image])
        for image in images])


def test_steps_before_the_switch_train_on_resized_images(tmp_path):
    classifier, data = module(), Batches(n=64, batch_size=8)
    seen = record_inputs(classifier.model)
    trainer(tmp_path, max_steps=8, limit_val_batches=0).fit(classifier, data)
    assert classifier.low_res_steps == 4  # half of the 8 steps
    assert [tuple(x.shape[-2:]) for x in seen] == [(8, 8)] * 4 + [(16, 16)] * 4
    for step, x in enumerate(seen):
        full = data.images[step * 8:(step + 1) * 8]
        torch.testing.assert_close(x, pil_resize(full, 8) if step < 4 else full, atol=1e-5, rtol=0)
    assert classifier.low_res_cost == 4.0


def test_validation_and_the_teacher_see_full_size_images(tmp_path):
    classifier = module(low_res_until=1.0)
    teacher = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(10))
    teacher(torch.zeros(1, 3, 16, 16))
    classifier.set_teacher(teacher.eval().requires_grad_(False))
    taught, seen = record_inputs(teacher), record_inputs(classifier.model)
    trainer(tmp_path, max_steps=2, limit_val_batches=1, val_check_interval=2).fit(classifier, Batches(n=16))
    assert [tuple(x.shape[-2:]) for x in taught] == [(16, 16)] * 2
    assert [tuple(x.shape[-2:]) for x in seen] == [(8, 8)] * 2 + [(16, 16)]  # two steps, then validation


class Refit(pl.Callback):
    """Refits the module's schedule to ``totals[step]`` steps after that optimizer step, as TimeBudget does."""

    def __init__(self, totals: dict[int, int]):
        self.totals = totals

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.totals:
            pl_module.refit_schedule(self.totals[trainer.global_step])


def test_the_switch_moves_with_a_refit_until_it_is_reached(tmp_path):
    classifier = module()  # half of 12 steps: 6, until the refits
    seen = record_inputs(classifier.model)
    refits = Refit({2: 8, 5: 100})  # 8 steps: the switch moves to 4; past it, a longer schedule leaves it there
    trainer(tmp_path, max_steps=12, limit_val_batches=0, callbacks=[refits]).fit(classifier, Batches(n=96))
    assert classifier.low_res_steps == 4
    assert [tuple(x.shape[-2:]) for x in seen] == [(8, 8)] * 4 + [(16, 16)] * 8


def test_a_resumed_run_keeps_its_switch(tmp_path):
    first = module()
    run = trainer(tmp_path, max_steps=4, limit_val_batches=0)
    run.fit(first, Batches(n=64))
    run.save_checkpoint(tmp_path / "last.ckpt")
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["low_res_steps"] == 2
    resumed = module()
    seen = record_inputs(resumed.model)
    trainer(tmp_path, max_steps=12, limit_val_batches=0).fit(resumed, Batches(n=64), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.low_res_steps == 2  # not half of the new 12 steps
    assert {tuple(x.shape[-2:]) for x in seen} == {(16, 16)}


def test_a_model_that_cannot_take_the_size_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"low_res_size 8: vit_nano does not take 8x8 images \(a ViT takes it with "
                                         r"model_args.dynamic_img_size: true\)"):
        ImageClassifier("vit_nano", {**TINY, "dynamic_img_size": False}, low_res_size=8)
    with pytest.raises(ValueError, match="low_res_size 6: .* must be divisible by patch_size"):
        ImageClassifier("vit_nano", TINY, low_res_size=6)
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


class FakeClock:
    """``time.perf_counter`` for TimeBudget: each forward of the model moves it on by ``per_pixel`` seconds per
    image pixel, so a full-size (16 x 16) step costs 4 times a low-res (8 x 8) one, whatever the machine."""

    def __init__(self, model: torch.nn.Module, per_pixel: float):
        self.now = 0.0
        model.register_forward_pre_hook(lambda m, args: self.advance(per_pixel * args[0][0, 0].numel()))

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def perf_counter(self) -> float:
        return self.now


def test_the_budget_fits_and_keeps_two_step_costs(tmp_path, monkeypatch):
    """A run of 3 (fake) seconds whose full-size steps cost 0.04 s and low-res ones 0.01 s: the budget fits the
    switch and the step count from the low-res time and the pixel ratio, measures the full-size steps after the
    switch, and stops inside the budget after the steps its formula gives."""
    from types import SimpleNamespace

    import zoo.train.callbacks as callbacks
    import zoo.train.forecast as forecast

    classifier = module(low_res_until=0.5)
    clock = FakeClock(classifier.model, per_pixel=0.01 / 64)
    for where in (callbacks, forecast):
        monkeypatch.setattr(where, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    budget = TimeBudget(budget_s=3.0, measure_steps=4, skip_steps=1)
    seen = record_inputs(classifier.model)
    trainer(tmp_path, max_epochs=100, limit_val_batches=0, callbacks=[budget]).fit(classifier, Batches(n=320))
    assert budget.step_time == pytest.approx(0.01) and budget.full_step_time == pytest.approx(0.04)
    switch = classifier.low_res_steps
    assert [tuple(x.shape[-2:]) for x in seen] == [(8, 8)] * switch + [(16, 16)] * (len(seen) - switch)
    assert len(seen) == budget.total_steps == simulated_total(0, 3.0, 0.0, 40, 0.01, 0.04, 0.5)
    assert clock.now <= 3.0 + 1e-9


def test_a_busy_start_does_not_cut_the_run_short(tmp_path, monkeypatch):
    """The machine is 4 times slower while the first 40 steps run (the first step time is measured then), then
    normal: the windows of ``REFIT_EVERY`` steps measure the real step time again, and the run ends inside its
    budget with less than two windows' worth of steps unspent (the first measurement alone would have stopped
    it after about a third of the budget)."""
    from types import SimpleNamespace

    import zoo.train.callbacks as callbacks
    import zoo.train.forecast as forecast

    classifier = ImageClassifier("vit_nano", TINY, num_classes=10)  # no resizing: one step cost
    clock = FakeClock(classifier.model, per_pixel=0.0)
    steps = []

    def step_cost(module, args):  # a pre-hook's return value would replace the inputs
        steps.append(1)
        clock.advance(0.04 if len(steps) <= 40 else 0.01)

    classifier.model.register_forward_pre_hook(step_cost)
    for where in (callbacks, forecast):
        monkeypatch.setattr(where, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    budget = TimeBudget(budget_s=6.0, measure_steps=4, skip_steps=1)
    trainer(tmp_path, max_epochs=100, limit_val_batches=0, callbacks=[budget]).fit(classifier, Batches(n=320))
    assert budget.step_time == pytest.approx(0.01)
    assert 6.0 - 2 * TimeBudget.REFIT_EVERY * 0.01 <= clock.now <= 6.0 + 1e-9


def forecast_run(recipe, low_res_steps: int, **kwargs):
    """A RunForecast on a fake trainer at step 0 (351 steps an epoch, 10 validation batches, one pass each)."""
    from types import SimpleNamespace

    from zoo.train.forecast import RunForecast

    trainer = SimpleNamespace(global_step=0, estimated_stepping_batches=recipe.epochs * 351, num_training_batches=351,
                              accumulate_grad_batches=1, num_val_batches=[10], is_global_zero=True,
                              progress_bar_callback=None, precision="32", callbacks=[])
    module = SimpleNamespace(eval_passes=1, low_res_steps=low_res_steps, device=torch.device("cpu"))
    forecast = RunForecast(recipe, "cpu", "a test CPU", **kwargs)
    forecast._fit_t0 = time.perf_counter()  # as on_fit_start
    return forecast, trainer, module


def test_the_time_left_counts_full_size_steps_at_their_cost():
    """An epoch-scheduled run whose step time was measured on 16 x 16 images: by hand, the steps before the switch
    at that time, those after at 4 times it (32 x 32), one full-size validation per epoch left."""
    recipe = resolve_config("vit_tiny", overrides=["low_res_size=16", "model_args.dynamic_img_size=true"])
    total = recipe.epochs * 351
    switch = int(recipe.low_res_until * total)
    forecast, trainer, module = forecast_run(recipe, switch)
    for step in range(1, 5):  # one step left out, three measured
        trainer.global_step = step
        forecast.on_train_batch_end(trainer, module, None, None, step - 1)
    low = forecast.step_time
    expected = (switch - 4) * low + (total - switch) * 4 * low + math.ceil((total - 4) / 351) * (4 * low / 3 * 10)
    assert forecast.remaining_s(trainer, module) - forecast._test_time(module) == pytest.approx(expected)
    assert f"{low:.3g} s a step at 16x16, {4 * low:.3g} s at 32x32, measured" in forecast.lines[0]


def test_the_plan_line_counts_the_steps_a_budget_buys_at_two_step_costs():
    """Under --max-time, before TimeBudget has fitted its schedule: from the probe's full-size step (2 s), a 16 x 16
    step costs a quarter, and the steps are those of the step-by-step simulation."""
    recipe = resolve_config("vit_tiny", overrides=["low_res_size=16", "model_args.dynamic_img_size=true",
                                                   "max_time=00:00:10:00"])
    forecast, trainer, module = forecast_run(recipe, 0, budget_s=600.0, probe_step_s=2.0)
    forecast.on_train_start(trainer, module)
    val = 2.0 / 3 * 10  # a full-size validation: a third of a step per batch
    expected = simulated_total(0, 600.0, val, 351, 0.5, 2.0, recipe.low_res_until)
    assert abs(forecast.total_steps(trainer, module) - expected) <= 1
    assert "0.5 s a step at 16x16, 2 s at 32x32, timed before training" in forecast.lines[0]
