"""Every registered model, timm-style: training step, heads and pooled features, bf16 autocast, channels_last,
parameter / FLOP counts against hand formulas, input errors, torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zoo
from zoo.models.vit import VisionTransformer

NAMES = zoo.list_models()
_eval_models: dict[str, nn.Module] = {}


def eval_model(name: str) -> nn.Module:
    """One default model per name in eval mode, shared by the tests that do not change it."""
    if name not in _eval_models:
        torch.manual_seed(0)
        _eval_models[name] = zoo.create_model(name).eval()
    return _eval_models[name]


def batch(n: int = 2, channels: int = 3, size: int = 32) -> torch.Tensor:
    return torch.randn(n, channels, size, size)


@pytest.mark.parametrize("name", NAMES)
def test_train_step_reaches_every_parameter(name):
    model = zoo.create_model(name, num_classes=5).train()
    out = model(batch())
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.logsumexp(-1).sum().backward()
    # "receives" = is in the graph; values may be exactly 0 at init (timm's zero-init last BN gamma,
    # ReLU units of a small CBAM MLP that are all off for a batch)
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_heads_and_pooled_features(name):
    x = batch()
    model = zoo.create_model(name, num_classes=0).eval()
    with torch.no_grad():
        pooled = model(x)
        assert pooled.dim() == 2 and pooled.shape[0] == 2 and torch.isfinite(pooled).all()
        torch.testing.assert_close(model.forward_head(model.forward_features(x), pre_logits=True), pooled)
        model.reset_classifier(7)
        head = model.get_classifier()
        torch.testing.assert_close(model(x), F.linear(pooled, head.weight, head.bias), atol=1e-5, rtol=1e-5)
        model.reset_classifier(0)
        torch.testing.assert_close(model(x), pooled)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_autocast_cpu(name):
    model = eval_model(name)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch(1))
    assert out.shape == (1, 10) and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("name", NAMES)
def test_channels_last_input(name):
    model = eval_model(name)
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(x.contiguous(memory_format=torch.channels_last)), model(x),
                                   atol=1e-4, rtol=1e-4)


def hand_flops(model: nn.Module, x: torch.Tensor) -> int:
    """Matmul FLOPs of one forward (a multiply-add = 2), per image, from the shapes each layer sees:
    every conv and linear layer, plus the two attention matmuls (q k^T and weights v) of every
    zoo.MultiHeadAttention: 2 * N * M * dim each."""
    total = 0

    def layer(module, inputs, kwargs, out):
        nonlocal total
        if isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            total += 2 * out.numel() * module.in_channels // module.groups * kh * kw
        elif isinstance(module, nn.Linear):
            total += 2 * out.numel() * module.in_features
        else:
            q = inputs[0]
            context = inputs[1] if len(inputs) > 1 else kwargs.get("context")
            context = q if context is None else context
            total += 2 * 2 * q.shape[0] * q.shape[1] * context.shape[1] * module.dim

    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear, zoo.MultiHeadAttention))]
    hooks = [m.register_forward_hook(layer, with_kwargs=True) for m in layers]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return total // x.shape[0]


@pytest.mark.parametrize("name", NAMES)
def test_model_info_counts(name):
    model = eval_model(name)
    info = zoo.model_info(model)
    assert info["params"] == sum(p.numel() for p in model.parameters()) == info["trainable_params"]
    assert info["input_size"] == (3, 32, 32)
    expected = hand_flops(model, batch(1))
    assert info["flops"] > 0 and info["flops"] == pytest.approx(expected, rel=0.01)


def test_model_info_leaves_the_model_untouched_even_while_counting():
    """A training-mode model with BatchNorm, dropout, drop path, CBAM and attention (one module on an explicit
    backend, the rest on "auto"), compiled in place as ``zoo-train --compile`` leaves it: during the count no
    module's training flag or backend differs (checked by a pre-hook on every module), afterwards no buffer
    (BatchNorm statistics) and no random-number state has changed, and the FLOPs are those of the model in
    eval mode, equal to the hand formula."""
    kwargs = dict(drop_rate=0.1, drop_path_rate=0.1)
    model = zoo.create_model("hybrid_tiny", **kwargs).train()
    attention = [m for m in model.modules() if isinstance(m, zoo.MultiHeadAttention)]
    attention[0].backend = "chunked"
    model.compile()
    modules = list(model.modules())

    def settings():
        return [(m.training, getattr(m, "backend", None)) for m in modules]

    before, state, rng = settings(), {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()
    checked = []
    hooks = [m.register_forward_pre_hook(lambda module, args: checked.append(settings() == before))
             for m in modules]
    try:
        with zoo.attention_backend("math"):
            flops = zoo.model_info(model)["flops"]
    finally:
        for h in hooks:
            h.remove()
    assert checked and all(checked), "a module's training flag or backend changed during the count"
    assert settings() == before and all(m.training for m in modules)
    assert [m.backend for m in attention] == ["chunked"] + ["auto"] * (len(attention) - 1)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    reference = zoo.create_model("hybrid_tiny", **kwargs).eval()
    assert flops == zoo.model_info(reference)["flops"] == pytest.approx(hand_flops(reference, batch(1)), rel=0.01)


def test_model_info_counts_attention_alike_under_every_exact_backend():
    """sdpa (its fused CPU kernel, through model_info's FLOP formula for it), math and chunked: one count."""
    model = eval_model("vit_nano")
    counts = {}
    for backend in ("sdpa", "math", "chunked"):
        with zoo.attention_backend(backend):
            counts[backend] = zoo.model_info(model)["flops"]
    assert len(set(counts.values())) == 1, counts
    assert counts["sdpa"] == pytest.approx(hand_flops(model, batch(1)), rel=0.01)


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("vit_")])
def test_vit_flops_match_closed_form(name):
    vit = eval_model(name)
    assert isinstance(vit, VisionTransformer)
    d, (p, _), depth = vit.embed_dim, vit.patch_size, len(vit.blocks)
    n = vit.grid_size[0] * vit.grid_size[1]
    t = n + vit.num_prefix_tokens
    hidden = vit.blocks[0].mlp.fc1.out_features
    patch_embed = 2 * n * (3 * p * p) * d
    block = 2 * t * d * 3 * d + 2 * t * d * d + 2 * 2 * t * d * hidden + 2 * 2 * t * t * d
    expected = patch_embed + depth * block + 2 * d * vit.num_classes
    assert zoo.model_info(vit)["flops"] == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("name", NAMES)
def test_wrong_input_raises(name):
    model = eval_model(name)
    with pytest.raises(ValueError, match=r"\(B, 3, .*got \(1, 1, 32, 32\)"):  # expected and given
        model(batch(1, channels=1))
    with pytest.raises(ValueError, match=r"got \(3, 32, 32\)"):  # no batch axis
        model(batch(1)[0])
    with pytest.raises(ValueError, match="got dtype torch.uint8"):  # raw pixels, not normalised
        model(batch(1).to(torch.uint8))
    if hasattr(model, "grid_size"):  # models with a fixed token grid accept only their img_size
        with pytest.raises(ValueError, match=r"\(B, 3, 32, 32\), got \(1, 3, 48, 48\)"):
            model(batch(1, size=48))


@pytest.mark.parametrize("name", NAMES)
def test_nan_input_gives_nan_not_an_error_and_inputs_of_any_layout_work(name):
    model = eval_model(name)
    x = batch(2)
    with torch.no_grad():
        reference = model(x)
        for strided in (x.contiguous(memory_format=torch.channels_last), x.transpose(2, 3).contiguous().mT):
            torch.testing.assert_close(model(strided), reference, atol=1e-4, rtol=1e-4)
        poisoned = x.clone()
        poisoned[0] = float("nan")
        out = model(poisoned)
    assert out[0].isnan().all()
    torch.testing.assert_close(out[1], reference[1])  # nothing mixes samples in eval mode


def compile_check(name: str) -> None:
    model = eval_model(name)
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model)(x), model(x), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_torch_compile(name):
    compile_check(name)


@pytest.mark.parametrize("family", ["hybrid", pytest.param("resnet_cbam", marks=pytest.mark.slow)])
def test_torch_compile_one_small_model_per_conv_family(family):
    """Compile check for the conv families (the ViT family's is in test_vit.py): small members, so inductor
    compiles in seconds. The hybrid's runs in the default suite; the ResNet's (a minute on an AVX2-only CPU) and
    every registered model's behind the slow marker."""
    from timm.models.resnet import BasicBlock

    from zoo.models.resnet import CifarResNet

    if family == "hybrid":
        model = zoo.create_model("hybrid_tiny", stem_chs=(8, 16), embed_dim=32, depth=1, num_heads=2)
    else:
        model = zoo.add_cbam(CifarResNet(BasicBlock, [1, 1, 1, 1], num_classes=10))
    model.eval()
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model)(x), model(x), atol=1e-4, rtol=1e-4)
