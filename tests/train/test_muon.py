"""``MuonAdamW`` against torch's own optimizers run separately on a copy of the model (Muon on the 2-D weights
but the head's, AdamW on the rest), its first Muon step against the Newton-Schulz formula written out, the
state_dict round trip against an uninterrupted run, and the learning-rate schedule reaching both halves."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import zoo
from zoo.bench.dispatch import OpRecorder
from zoo.runtime.device import cpu_has_native_bf16
from zoo.train.optim import FilterMuon, MuonAdamW, build_optimizer, muon_split, param_groups


def _model():
    torch.manual_seed(0)
    return zoo.create_model("hybrid_tiny")


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    return F.cross_entropy(model(x), y)


def _optimizer(model, muon_dtype: str = "bfloat16"):
    head = {id(p) for p in model.get_classifier().parameters()}
    return build_optimizer("muon", param_groups(model, 2e-3, 0.05), 2e-3, momentum=0.95, muon_exclude=head,
                           muon_dtype=muon_dtype)


def _step(model, optimizer, seed):
    optimizer.zero_grad()
    _loss(model, seed).backward()
    optimizer.step()


def test_split_puts_decayed_matrices_but_the_head_on_muon():
    model = _model()
    head = {id(p) for p in model.get_classifier().parameters()}
    muon, adamw = muon_split(param_groups(model, 2e-3, 0.05), head)
    on_muon = {id(p) for g in muon for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    expected = {n for n, p in model.named_parameters()
                if p.ndim == 2 and n not in model.no_weight_decay() and not n.startswith("head.")}
    assert {names[i] for i in on_muon} == expected and "blocks.0.attn.qkv.weight" in expected
    assert sum(len(g["params"]) for g in muon + adamw) == len(list(model.parameters()))
    assert all(g["weight_decay"] == 0.05 for g in muon)


def test_split_with_filters_adds_the_conv_filters():
    model = _model()
    head = {id(p) for p in model.get_classifier().parameters()}
    groups = param_groups(model, 2e-3, 0.05)
    matrices = {id(p) for g in muon_split(groups, head)[0] for p in g["params"]}
    muon, adamw = muon_split(groups, head, filters=True)
    on_muon = {id(p) for g in muon for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    filters = {n for n, p in model.named_parameters() if p.ndim == 4}
    assert {names[i] for i in on_muon - matrices} == filters and "stem.3.0.weight" in filters
    assert matrices < on_muon and sum(len(g["params"]) for g in muon + adamw) == len(list(model.parameters()))


def test_muon_on_a_model_without_weight_matrices_names_the_optimizers_that_apply():
    """A CNN's weights but its head are conv filters: muon has nothing to step (torch's Muon would refuse an empty
    parameter list in its own words), muon_conv steps the filters."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 30 * 30, 10))
    groups, head = param_groups(model, 2e-3, 0.05), {id(p) for p in model[2].parameters()}
    with pytest.raises(ValueError, match="no weight matrix for Muon .* --optimizer muon_conv .* or adamw"):
        build_optimizer("muon", groups, 2e-3, muon_exclude=head)
    stepped = build_optimizer("muon_conv", groups, 2e-3, muon_exclude=head).muon.param_groups
    assert [p for g in stepped for p in g["params"]] == [model[0].weight]


def _filter_steps(weight, seeds, **kwargs):
    optimizer = FilterMuon([{"params": [weight], "weight_decay": 0.05}], lr=0.02, **kwargs)
    for seed in seeds:
        weight.grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed))
        optimizer.step()
    return optimizer


def test_filter_muon_is_torch_muon_on_the_flattened_filter():
    torch.manual_seed(2)
    start = torch.randn(16, 8, 3, 3)
    weight = torch.nn.Parameter(start.clone())
    _filter_steps(weight, range(3))
    # reference: torch's Muon on the (16, 72) matrix, fed the same gradients flattened
    matrix = torch.nn.Parameter(start.reshape(16, -1).clone())
    muon = torch.optim.Muon([matrix], lr=0.02, weight_decay=0.05, momentum=0.95, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    for seed in range(3):
        matrix.grad = torch.randn(start.shape, generator=torch.Generator().manual_seed(seed)).reshape(16, -1)
        muon.step()
    torch.testing.assert_close(weight.detach(), matrix.detach().reshape(start.shape), rtol=0, atol=0)
    assert not torch.equal(weight.detach(), start)


def test_filter_muon_channels_last_matches_contiguous():
    torch.manual_seed(3)
    start = torch.randn(16, 8, 3, 3)
    plain = torch.nn.Parameter(start.clone())
    last = torch.nn.Parameter(start.clone().to(memory_format=torch.channels_last))
    _filter_steps(plain, range(3))
    optimizer = _filter_steps(last, range(3))
    assert last.is_contiguous(memory_format=torch.channels_last)  # updated in place, layout kept
    assert optimizer.state[last]["momentum_buffer"].shape == (16, 72)
    # the columns come in another order, so the bf16 Newton-Schulz sums differ in rounding only
    torch.testing.assert_close(last.detach(), plain.detach(), rtol=0, atol=2e-3)
    assert (last.detach() - start).abs().max() > 0.01


def test_steps_equal_torch_muon_and_adamw_run_separately():
    """Bit for bit over three steps where the CPU computes bf16 natively. Where it emulates bf16 (AVX2 only), a
    batched bf16 matmul and a per-matrix one (and a matrix and its transpose) round differently: there one step is
    compared, AdamW's tensors bit for bit and each Muon update within 2% of its norm (bf16 keeps 8 bits; five
    Newton-Schulz iterations amplify the rounding, 1.6% measured on a Zen 1)."""
    model = _model()
    reference = copy.deepcopy(model)
    start = [p.detach().clone() for p in reference.parameters()]
    optimizer = _optimizer(model)
    head = {id(p) for p in reference.get_classifier().parameters()}
    muon_groups, adamw_groups = muon_split(param_groups(reference, 2e-3, 0.05), head)
    muon = torch.optim.Muon(muon_groups, lr=2e-3, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(adamw_groups, lr=2e-3)
    exact = cpu_has_native_bf16()  # the hardware's own bf16 path, not the ZOO_NATIVE_BF16 override
    for seed in range(3 if exact else 1):
        _step(model, optimizer, seed)
        muon.zero_grad(), adamw.zero_grad()
        _loss(reference, seed).backward()
        muon.step(), adamw.step()
    on_muon = {id(p) for group in muon_groups for p in group["params"]}
    for (name, p), q, s in zip(model.named_parameters(), reference.parameters(), start, strict=True):
        if exact or id(q) not in on_muon:
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        else:
            assert ((p - q).norm() / (q - s).norm()).item() <= 0.02, name


def test_first_muon_step_is_the_orthogonalised_gradient():
    torch.manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(8, 16))
    bias = torch.nn.Parameter(torch.zeros(8))
    optimizer = MuonAdamW([{"params": [weight], "weight_decay": 0.0}], [{"params": [bias]}], lr=0.1, momentum=0.95)
    before = weight.detach().clone()
    weight.grad = torch.randn(8, 16)
    # Nesterov on a fresh buffer: grad.lerp(0.05 * grad, 0.95); then 5 quintic Newton-Schulz steps (fp64 here,
    # bf16 in torch: so the update is compared by relative error, against a gap the iteration itself makes)
    x = weight.grad.double().lerp(0.05 * weight.grad.double(), 0.95)
    x = x / x.norm()
    a, b, c = 3.4445, -4.775, 2.0315
    raw = x.clone()
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    optimizer.step()
    update = (before - weight.detach()).double() / (0.1 * 0.2 * math.sqrt(16))  # match_rms_adamw's scale
    assert (update - x).norm() / x.norm() < 0.03
    assert (raw / raw.norm() * x.norm() - x).norm() / x.norm() > 0.3  # not the plain normalised gradient
    singular = torch.linalg.svdvals(update)
    assert singular.min() > 0.5 and singular.max() < 1.5  # near-orthogonal, as Muon's iteration leaves it


def test_state_dict_round_trip_resumes_the_same_run():
    model = _model()
    optimizer = _optimizer(model, "float32")  # the round trip holds in either dtype; emulated bf16 takes seconds a step
    for seed in range(2):
        _step(model, optimizer, seed)
    saved_model, saved_state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    _step(model, optimizer, 2)

    resumed = _model()
    resumed.load_state_dict(saved_model)
    again = _optimizer(resumed, "float32")
    again.load_state_dict(saved_state)
    assert again.muon.state is again.state and again.adamw.param_groups[0] is again.param_groups[
        len(again.muon.param_groups)]
    _step(resumed, again, 2)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_schedule_and_closure_reach_both_halves():
    model = _model()
    optimizer = _optimizer(model, "float32")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert all(g["lr"] == pytest.approx(1e-3) for g in optimizer.muon.param_groups + optimizer.adamw.param_groups)
    calls = []

    def closure():
        calls.append(1)
        optimizer.zero_grad()
        loss = _loss(model, 0)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    assert torch.isfinite(optimizer.step(closure)) and calls == [1]
    scheduler.step()
    moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
    assert all(moved)


class ScalerUnaware(MuonAdamW):
    """MuonAdamW as torch's optimizers without scaler support: the scaler unscales, reads its inf flag and skips."""

    _step_supports_amp_scaling = False


def _fused(model, kind: type[MuonAdamW] = MuonAdamW):
    head = {id(p) for p in model.get_classifier().parameters()}
    muon, adamw = muon_split(param_groups(model, 2e-3, 0.05), head)
    # fp32 Newton-Schulz: the scaler's path does not depend on it, and CPUs without native bf16 emulate it slowly
    return kind(muon, adamw, 2e-3, momentum=0.95, fused=True, ns_dtype=torch.float32)


def _scaled_step(model, optimizer, scaler, seed, poison: bool = False):
    """One 16-mixed step as Lightning takes it with an optimizer that unscales in its step: scaled backward,
    ``scaler.step`` (no ``unscale_`` first), ``scaler.update``; recorded op by op. ``poison``: one Muon
    gradient holds an inf, as an fp16 overflow leaves it."""
    optimizer.zero_grad()
    scaler.scale(_loss(model, seed)).backward()
    if poison:
        optimizer.muon.param_groups[0]["params"][0].grad[0, 0] = float("inf")
    with OpRecorder() as ops:
        scaler.step(optimizer)
        scaler.update()
    return ops


def test_a_grad_scaler_steps_on_the_device_as_it_steps_by_itself():
    """With fused AdamW (on a GPU) a GradScaler hands MuonAdamW its scale and inf flag: the steps equal the
    scaler's own unscale, check and step of the same scaled gradients (each skipping the step with an inf), and
    neither step nor update reads the flag on the host (the scaler's own path reads it with ``.item()``)."""
    model, reference = _model(), _model()
    optimizer, plain = _fused(model), _fused(reference, ScalerUnaware)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    assert optimizer._step_supports_amp_scaling and not plain._step_supports_amp_scaling
    for seed in range(4):
        ops = _scaled_step(model, optimizer, scalers[0], seed, poison=seed == 2)
        assert [c.name for c in ops.syncs] == []
        assert [c.name for c in _scaled_step(reference, plain, scalers[1], seed, poison=seed == 2).syncs]
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**10  # grew, backed off, grew
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_a_grad_scaler_step_on_an_overflow_leaves_weights_and_state_as_they_were():
    model = _model()
    optimizer = _fused(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _scaled_step(model, optimizer, scaler, 0)
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    ops = _scaled_step(model, optimizer, scaler, 1, poison=True)
    assert [c.name for c in ops.syncs] == [] and scaler.get_scale() == 2.0**9  # backed off, read after the step
    for name, tensor in model.named_parameters():  # (the step's forward moved BatchNorm's running statistics)
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0, msg=name)
    for key, saved in state["state"].items():
        for field, value in saved.items():
            torch.testing.assert_close(optimizer.state_dict()["state"][key][field], value, rtol=0, atol=0,
                                       msg=f"{key}.{field}")


class _LargestNewTensor(TorchDispatchMode):
    """The size in bytes of the largest tensor an op returns in memory none of its arguments hold."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_steps_reuse_the_iteration_buffers_and_match_fresh_ones():
    torch.manual_seed(4)
    starts = [torch.randn(24, 40) for _ in range(4)] + [torch.randn(40, 24) for _ in range(4)]  # one wide shape
    reused, fresh = ([torch.nn.Parameter(s.clone()) for s in starts] for _ in range(2))
    steady = FilterMuon([{"params": reused, "weight_decay": 0.05}], lr=0.02)
    allocating = FilterMuon([{"params": fresh, "weight_decay": 0.05}], lr=0.02)
    allocating._workspace = None  # newton_schulz then allocates its stack and products afresh at every step
    sizes = []
    for seed in range(3):
        for p, q in zip(reused, fresh, strict=True):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
            q.grad = p.grad.clone()
        with _LargestNewTensor() as new:
            steady.step()
        sizes.append(new.largest)
        allocating.step()
    stack = 8 * 24 * 40 * 2  # the eight matrices stacked in bf16
    assert sizes[0] >= stack and max(sizes[1:]) < stack, sizes  # the first step makes the buffers, later ones reuse
    for p, q in zip(reused, fresh, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
