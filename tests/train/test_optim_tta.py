"""Recipe pieces against hand formulas: the warm-up + linear / cosine schedule, the parameter groups and their
learning-rate scale, the optimisers, the EMA's warm-up decay, and airbench's test-time augmentation written
out by hand."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zoo
from zoo.bench.dispatch import OpRecorder
from zoo.models.tta import tta_logits
from zoo.train.optim import WarmupDecay, build_optimizer, ema_multi_avg_fn, param_groups


def test_linear_and_cosine_schedules():
    linear = WarmupDecay(10, 110, min_ratio=0.0, shape="linear")
    cosine = WarmupDecay(10, 110, min_ratio=0.1, shape="cosine")
    assert linear(0) == pytest.approx(1 / 11) and linear(9) == pytest.approx(10 / 11)
    assert linear(10) == pytest.approx(1.0) and linear(60) == pytest.approx(0.5) and linear(110) == 0.0
    assert linear(500) == 0.0
    assert cosine(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    with pytest.raises(ValueError, match="schedule must be one of"):
        WarmupDecay(1, 10, shape="step")


def test_param_groups_split_and_scale():
    model = zoo.create_model("hybrid_tiny")
    groups = param_groups(model, lr=0.1, weight_decay=5e-4, no_decay_lr_scale=4.0)
    by_decay = {g["weight_decay"]: g for g in groups}
    assert by_decay[5e-4]["lr"] == 0.1 and by_decay[0.0]["lr"] == pytest.approx(0.4)
    no_decay_ids = {id(p) for p in by_decay[0.0]["params"]}
    for name, p in model.named_parameters():
        expected = p.ndim <= 1 or name in model.no_weight_decay()
        assert (id(p) in no_decay_ids) == expected, name
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_optimizers():
    weight = nn.Parameter(torch.ones(3))
    sgd = build_optimizer("sgd", [{"params": [weight], "lr": 0.1}], 0.1, momentum=0.85)
    assert sgd.param_groups[0]["nesterov"] and sgd.param_groups[0]["momentum"] == 0.85
    assert isinstance(build_optimizer("adamw", [{"params": [weight]}], 0.1), torch.optim.AdamW)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        build_optimizer("lion", [{"params": [weight]}], 0.1)


def test_ema_copies_first_then_warms_up_its_decay_without_a_sync():
    average = ema_multi_avg_fn(0.99)
    current = [torch.randn(3), torch.randn(2, 2)]
    averaged = [torch.randn(3), torch.randn(2, 2)]
    with OpRecorder() as ops:
        average(averaged, current, torch.tensor(0))  # the first update copies
    assert ops.syncs == [] and all(torch.equal(a, c) for a, c in zip(averaged, current, strict=True))
    for n, kept in ((1, 2 / 11), (10_000, 0.99)):  # min(0.99, (1 + n) / (10 + n)) of the average kept
        before, current = [a.clone() for a in averaged], [torch.randn(3), torch.randn(2, 2)]
        average(averaged, current, torch.tensor(n))
        for a, b, c in zip(averaged, before, current, strict=True):
            torch.testing.assert_close(a, kept * b + (1 - kept) * c)
    with pytest.raises(ValueError, match=r"ema_decay must lie in \(0, 1\)"):
        ema_multi_avg_fn(1.0)


def test_tta_levels_by_hand():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(5))
    x = torch.randn(2, 3, 8, 8)
    model(x)
    with torch.no_grad():
        assert torch.equal(tta_logits(model, x, 0), model(x))
        mirror = 0.5 * (model(x) + model(x.flip(3)))
        assert torch.allclose(tta_logits(model, x, 1), mirror)
        padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
        up_left, down_right = padded[:, :, 0:8, 0:8], padded[:, :, 2:10, 2:10]
        shifted = [0.5 * (model(s) + model(s.flip(3))) for s in (up_left, down_right)]
        expected = 0.5 * mirror + 0.25 * (shifted[0] + shifted[1])
        assert torch.allclose(tta_logits(model, x, 2), expected, atol=1e-6)
    with pytest.raises(ValueError, match="tta level must be one of"):
        tta_logits(model, x, 3)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):  # bf16 logits, averaged in float32
        views = model(x), model(x.flip(3))
        averaged = tta_logits(model, x, 1)
    assert views[0].dtype == torch.bfloat16 and averaged.dtype == torch.float32
    assert torch.equal(averaged, 0.5 * (views[0].float() + views[1].float()))


def test_auto_precision_follows_the_cpu_flags(tmp_path, monkeypatch):
    from zoo.runtime import device

    plain, bf16 = tmp_path / "plain", tmp_path / "bf16"
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n")
    bf16.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n")
    assert not device.cpu_has_native_bf16(str(plain)) and device.cpu_has_native_bf16(str(bf16))
    assert not device.cpu_has_native_bf16(str(tmp_path / "missing"))
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert device.resolve_precision("auto", "cpu") == "32"
    assert device.resolve_precision("auto", "cpu", faster=lambda options: pytest.fail("measured")) == "32"
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert device.resolve_precision("auto", "cpu") == "bf16-mixed"
    asked = []
    assert device.resolve_precision("auto", "cpu", faster=lambda options: asked.append(options) or "32") == "32"
    assert asked == [("32", "bf16-mixed")]  # the measurement decides between fp32 and bf16-mixed
    assert device.resolve_precision("16-mixed", "cpu") == "16-mixed"


class _SlowUnder(torch.nn.Module):
    """A BatchNorm whose forward sleeps 20 ms more when CPU autocast is ``slow_under`` (on or off)."""

    def __init__(self, slow_under: bool):
        super().__init__()
        self.norm, self.slow_under = torch.nn.BatchNorm1d(4), slow_under

    def forward(self, x):
        time.sleep(0.001 + 0.02 * (torch.is_autocast_enabled("cpu") == self.slow_under))
        return self.norm(x)


@pytest.mark.parametrize("slow_under,expected", [(True, "32"), (False, "bf16-mixed")])
def test_faster_precision_picks_the_faster_and_leaves_the_model_alone(slow_under, expected):
    from zoo.train.probes import faster_precision

    model = _SlowUnder(slow_under)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert faster_precision(model, torch.randn(8, 4), ("32", "bf16-mixed")) == expected
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # BatchNorm ran on a copy


@pytest.mark.parametrize("bf16_seconds,expected", [(0.97, "32"), (1.2, "32"), (0.9, "bf16-mixed")])
def test_faster_precision_keeps_fp32_unless_bf16_beats_it_by_the_margin(bf16_seconds, expected, monkeypatch):
    from zoo.train import probes

    monkeypatch.setattr(probes, "interleaved_medians", lambda fns, repeats: {"32": 1.0, "bf16-mixed": bf16_seconds})
    assert probes.faster_precision(torch.nn.Linear(4, 4), torch.randn(2, 4), ("32", "bf16-mixed"),
                                   margin=0.05) == expected


def test_remembered_choice_measures_once_per_key_and_survives_a_corrupt_file(tmp_path):
    from zoo.train.probes import remembered_choice

    path, calls = tmp_path / "sub" / "choices.json", []

    def choose(value):
        return lambda: calls.append(value) or value

    assert remembered_choice(path, "a", choose("bf16-mixed")) == ("bf16-mixed", True)
    assert remembered_choice(path, "a", choose("32")) == ("bf16-mixed", False)  # not measured again
    assert remembered_choice(path, "b", choose("32")) == ("32", True)
    assert json.loads(path.read_text()) == {"a": "bf16-mixed", "b": "32"}
    path.write_text('{"a": "bf16-mi')  # a torn write by some other tool
    assert remembered_choice(path, "a", choose("32")) == ("32", True)
    assert calls == ["bf16-mixed", "32", "32"] and json.loads(path.read_text()) == {"a": "32"}
    (tmp_path / "file").write_text("")
    assert remembered_choice(tmp_path / "file" / "choices.json", "a", choose("32")) == ("32", True)  # not writable


def test_alternating_flip_mirrors_each_image_in_every_other_epoch():
    from zoo.data.augment import AlternatingFlip

    epoch = {"now": 0}
    flip = AlternatingFlip(64, seed=3, epoch=lambda: epoch["now"])
    images = torch.arange(64 * 2 * 3, dtype=torch.float32).view(64, 1, 2, 3)
    index = torch.arange(64)
    seen = []
    for e in range(4):
        epoch["now"] = e
        out = flip(images, index)
        mirrored = (out == images.flip(-1)).flatten(1).all(1)
        assert torch.equal(out[mirrored], images.flip(-1)[mirrored])
        assert torch.equal(out[~mirrored], images[~mirrored])
        seen.append(mirrored)
    assert torch.equal(seen[0], ~seen[1]) and torch.equal(seen[0], seen[2]) and torch.equal(seen[1], seen[3])
    assert 16 < int(seen[0].sum()) < 48  # a random half, not all or none
    epoch["now"] = 0
    again = AlternatingFlip(64, seed=3, epoch=lambda: 0)(images, index)
    assert torch.equal(again, flip(images, index))  # the same seed starts from the same half
    subset = torch.tensor([5, 9])
    assert torch.equal(flip(images[subset], subset), flip(images, index)[subset])
