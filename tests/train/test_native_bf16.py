"""No emulated bf16 in a run that did not choose it. Muon's Newton-Schulz iteration in the dtype the device computes
natively (fp32 against an fp64 reference written out here, bf16 against torch's Muon, batched against one matrix at
a time), ``ZOO_NATIVE_BF16`` forcing the detection either way, GPU precision without emulated bf16, and a dispatch
mode over real training steps: with the detection off and precision 32 not one matmul / conv / attention op sees
bf16, for every optimizer and recipe option."""

from __future__ import annotations

import math

import pytest
import torch

from zoo.bench.dispatch import OpRecorder
from zoo.runtime import device
from zoo.train.optim import FilterMuon, newton_schulz

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch's Muon


def _reference_newton_schulz(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The iteration written out in fp64 on one matrix: X / ||X||_F, then X <- aX + (bA + cA^2)X, A = X X^T,
    on the wide orientation."""
    a, b, c = COEFFICIENTS
    x = matrix.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(16, 72), (72, 16), (32, 32)])
def test_newton_schulz_fp32_equals_an_fp64_reference(shape):
    g = torch.Generator().manual_seed(0)
    matrices = torch.randn(3, *shape, generator=g)
    got = newton_schulz(matrices, 5, COEFFICIENTS, 1e-7, torch.float32)
    assert got.dtype == torch.float32 and got.shape == matrices.shape
    for matrix, result in zip(matrices, got, strict=True):
        torch.testing.assert_close(result.double(), _reference_newton_schulz(matrix), rtol=0, atol=2e-5)


def test_newton_schulz_bf16_equals_torch_muon_iteration():
    from torch.optim._muon import _zeropower_via_newtonschulz

    matrix = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    got = newton_schulz(matrix[None], 5, COEFFICIENTS, 1e-7, torch.bfloat16)[0]
    torch.testing.assert_close(got, _zeropower_via_newtonschulz(matrix, COEFFICIENTS, 5, 1e-7), rtol=0, atol=0)


def _muon_reference_steps(start: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float, momentum: float):
    """torch's Muon update (Nesterov momentum, decoupled weight decay, "match_rms_adamw" rate) written out in fp64."""
    weight, buffer = start.double().reshape(start.shape[0], -1), torch.zeros(start.shape[0], math.prod(start.shape[1:]),
                                                                               dtype=torch.float64)
    for grad in grads:
        grad = grad.double().reshape(buffer.shape)
        buffer = momentum * buffer + (1 - momentum) * grad
        update = (1 - momentum) * grad + momentum * buffer
        weight = weight * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(buffer.shape)) * _reference_newton_schulz(update)
    return weight.reshape(start.shape)


def test_filter_muon_fp32_steps_equal_the_written_out_update():
    torch.manual_seed(2)
    starts = [torch.randn(16, 8, 3, 3), torch.randn(16, 8, 3, 3), torch.randn(12, 20)]  # two share a shape
    params = [torch.nn.Parameter(s.clone()) for s in starts]
    optimizer = FilterMuon([{"params": params, "weight_decay": 0.05}], lr=0.02, ns_dtype=torch.float32)
    grads = {i: [torch.randn(s.shape, generator=torch.Generator().manual_seed(10 * i + k)) for k in range(3)]
             for i, s in enumerate(starts)}
    for k in range(3):
        for i, p in enumerate(params):
            p.grad = grads[i][k].clone()
        optimizer.step()
    for i, (p, s) in enumerate(zip(params, starts, strict=True)):
        expected = _muon_reference_steps(s, grads[i], 0.02, 0.05, 0.95)
        torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=1e-5)


def test_batched_update_equals_one_matrix_at_a_time():
    torch.manual_seed(3)
    starts = [torch.randn(32, 16, 3, 3) for _ in range(3)]
    together = [torch.nn.Parameter(s.clone()) for s in starts]
    apart = [torch.nn.Parameter(s.clone()) for s in starts]
    one = FilterMuon([{"params": together, "weight_decay": 0.05}], lr=0.02, ns_dtype=torch.float32)
    each = [FilterMuon([{"params": [p], "weight_decay": 0.05}], lr=0.02, ns_dtype=torch.float32) for p in apart]
    for seed in range(2):
        for i, (p, q) in enumerate(zip(together, apart, strict=True)):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed * 7 + i))
            q.grad = p.grad.clone()
        one.step()
        for optimizer in each:
            optimizer.step()
    for p, q in zip(together, apart, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_filter_muon_refuses_other_dtypes():
    with pytest.raises(ValueError, match="ns_dtype"):
        FilterMuon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1, ns_dtype=torch.float16)


@pytest.mark.parametrize("value, flags, expected", [
    ("0", "avx512_bf16 amx_bf16", False), ("1", "avx2", True), ("", "avx2 fma", False), ("", "avx512_bf16", True),
])
def test_native_bf16_env_overrides_the_cpu_flags(value, flags, expected, tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"model name\t: test cpu\nflags\t\t: fpu sse {flags}\n")
    monkeypatch.setenv(device.NATIVE_BF16_ENV, value)
    assert device.cpu_has_native_bf16(str(cpuinfo)) is expected


def test_native_bf16_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(device.NATIVE_BF16_ENV, "yes")
    with pytest.raises(ValueError, match="ZOO_NATIVE_BF16 must be 0 or 1"):
        device.cpu_has_native_bf16()


@pytest.mark.parametrize("native, muon_dtype, precision", [("0", "float32", "32"), ("1", "bfloat16", None)])
def test_cpu_choices_follow_the_detection(native, muon_dtype, precision, monkeypatch):
    monkeypatch.setenv(device.NATIVE_BF16_ENV, native)
    assert device.resolve_muon_dtype("auto", "cpu") == muon_dtype
    assert device.resolve_muon_dtype("float32", "cpu") == "float32"  # an explicit setting wins
    if precision is not None:
        assert device.resolve_precision("auto", "cpu") == precision


@pytest.mark.parametrize("emulated_only, precision, muon_dtype", [(True, "16-mixed", "float32"),
                                                                  (False, "bf16-mixed", "bfloat16")])
def test_gpu_that_only_emulates_bf16_gets_fp16_amp_and_fp32_muon(emulated_only, precision, muon_dtype, monkeypatch):
    """torch.cuda.is_bf16_supported() says yes on a T4 / V100 (it counts emulation): the choice asks without it."""
    asked = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return including_emulation or not emulated_only

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert device.resolve_precision("auto", "gpu") == precision
    assert device.resolve_muon_dtype("auto", "gpu") == muon_dtype
    assert asked and not any(asked)


OPTIONS = {
    "airbench": ["ema_decay=0.99", "tta=2", "label_smoothing=0.2", "augment.alternating_flip=true"],
    "heavy_augment": ["augment.randaugment=true", "augment.mixup_alpha=0.2", "augment.cutmix_alpha=1.0",
                      "augment.cutout=8"],
}


# the default suite runs three of the sixteen fits (both detections, both option sets, Muon and AdamW); -m slow all
DEFAULT_FITS = {("0", "airbench", "muon_conv"), ("1", "heavy_augment", "muon_conv"), ("0", "heavy_augment", "adamw")}
FITS = [pytest.param(native, options, optimizer, id=f"{native}-{options}-{optimizer}",
                     marks=() if (native, options, optimizer) in DEFAULT_FITS else pytest.mark.slow)
        for native in ("0", "1") for options in OPTIONS for optimizer in ("adamw", "sgd", "muon", "muon_conv")]


@pytest.mark.parametrize("native, options, optimizer", FITS)
def test_training_steps_compute_bf16_only_where_it_is_native(native, options, optimizer, cifar_dir, tmp_path,
                                                             monkeypatch):
    """Real training steps (the loop's: training, validation with TTA, the test) of a small hybrid under a
    dispatch mode that sees every aten op's dtypes. Precision 32 with the detection off (a CPU that emulates bf16):
    not one bf16 matmul / conv / attention op. With it on, Muon's iteration runs in native bf16 (so the mode does
    see bf16 when there is some) and nothing else does."""
    from zoo.train.loop import fit
    from zoo.train.recipe import resolve_config

    monkeypatch.setenv(device.NATIVE_BF16_ENV, native)
    recipe = resolve_config(
        "hybrid_tiny", "configs/test_tiny.yaml",
        [f"optimizer={optimizer}", "momentum=0.95", *OPTIONS[options], "val_size=16"],
        {"data_dir": str(cifar_dir), "cache_dir": str(tmp_path / "cache"), "out": str(tmp_path / "runs"),
         "max_train_images": 64, "max_test_images": 16, "epochs": 1, "batch_size": 16, "limit_train_batches": 2,
         "limit_val_batches": 1, "limit_test_batches": 1, "precision": "32" if native == "1" else "auto"})
    with OpRecorder() as ops:
        fit(recipe)
    assert len(ops.compute) > 100  # the mode saw the training steps
    in_bf16 = ops.compute_in(torch.bfloat16)
    if native == "0" or optimizer in ("adamw", "sgd"):
        assert in_bf16 == [], sorted({c.name for c in in_bf16})
    else:  # Muon's iteration only: batched matmuls (bmm / baddbmm), no model op
        assert in_bf16 and {c.name for c in in_bf16} <= {"bmm", "baddbmm"}
