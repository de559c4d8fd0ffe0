"""benchmarks.modes: every mode runs a real training step (the weights move) and the table's ratios are the
ratios of its throughputs."""

from __future__ import annotations

import pytest
import torch

from benchmarks.modes import bench_modes, mode_steps, optimizer_costs

EAGER_MODES = ("fp32", "fp32_channels_last", "bf16_mixed_channels_last", "bf16_true")


def test_each_mode_trains_its_own_copy():
    steps, compile_s = mode_steps("resnet18", batch=2, modes=EAGER_MODES)
    assert compile_s == {} and set(steps) == set(EAGER_MODES)
    for step in steps.values():  # the closures own their models: a step changes only that copy
        cells = step.__closure__
        model = next(c.cell_contents for c in cells if isinstance(c.cell_contents, torch.nn.Module))
        before = [p.detach().clone() for p in model.parameters()]
        step()
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_ratios_are_throughput_ratios():
    (row,) = bench_modes(["vit_nano"], batch=2, repeats=1, modes=("fp32", "bf16_true"), infer_batch=4)
    assert row["bf16_true_vs_fp32"] == pytest.approx(row["bf16_true_img_s"] / row["fp32_img_s"])
    assert row["fp32_img_s"] > 0 and not any(k.endswith("compile_s") for k in row)
    assert row["infer_img_s"] > 0 and row["infer_bf16_mixed_img_s"] > 0
    with pytest.raises(ValueError, match="must include 'fp32'"):
        bench_modes(["vit_nano"], batch=2, repeats=1, modes=("bf16_true",))
    with pytest.raises(ValueError, match="mode must be one of"):
        mode_steps("vit_nano", batch=2, modes=("fp32", "fp64"))


def test_optimizer_costs_are_shares_of_the_step(monkeypatch):
    monkeypatch.setenv("ZOO_NATIVE_BF16", "0")
    rows = optimizer_costs("vit_nano", ("adamw", "muon"), batch=2, repeats=1, precisions=("32",))
    assert [(r["optimizer"], r["precision"], r["muon_dtype"]) for r in rows] == [("adamw", "32", "float32"),
                                                                               ("muon", "32", "float32")]
    adamw, muon = rows
    assert adamw["vs_adamw"] == 1.0 and muon["vs_adamw"] == pytest.approx(adamw["step_ms"] / muon["step_ms"])
    for row in rows:
        assert row["optimizer_share"] == pytest.approx(row["optimizer_ms"] / row["step_ms"])
        assert 0 <= row["optimizer_share"] < 1  # the step is timed apart: never a negative cost


def test_optimizer_costs_leave_out_an_optimizer_with_nothing_to_step(monkeypatch):
    monkeypatch.setenv("ZOO_NATIVE_BF16", "0")
    rows = optimizer_costs("resnet18", ("adamw", "muon", "muon_conv"), batch=2, repeats=1, precisions=("32",))
    assert [r["optimizer"] for r in rows] == ["adamw", "muon_conv"]  # resnet18's weights but the head are filters
