"""AttnLRP (zoo.explain.lrp) against independent references: lxt 2.1, the authors' implementation, on the same
small torchvision ViT and input; conservation (the relevance of the input sums to the explained logit) on every
zoo attention model, a timm ViT and a torchvision ViT with their additive terms zeroed; the zoo's and timm's
attention paths giving the same relevance for the same weights; and the relevance being linear in the target."""

from __future__ import annotations

import contextlib

import pytest
import timm
import torch
from torchvision.models.vision_transformer import VisionTransformer as TorchvisionViT

import zoo
from zoo.explain.lrp import lrp_rules
from zoo.explain.methods import applicable_methods, attribute
from zoo.models.interop import vit_to_timm

ADDITIVE = ("bias", "pos_embed", "cls_token", "reg_token", "class_token", "pos_embedding", "running_mean")
ATTENTION_MODELS = [n for n in zoo.list_models() if n.startswith(("vit", "hybrid"))]


def torchvision_vit() -> TorchvisionViT:
    torch.manual_seed(0)
    model = TorchvisionViT(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                           num_classes=10).eval()
    for p in model.parameters():  # weights far from their init, so every rule matters
        torch.nn.init.normal_(p, std=0.2 if p.dim() > 1 else 0.05)
    return model


def timm_vit() -> torch.nn.Module:
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48,
                             depth=2, num_heads=3, num_classes=10).eval()


@contextlib.contextmanager
def lxt_cp_lrp():
    """lxt's own rules for torchvision's ViT (AttnLRP outside the attention, CP-LRP inside), patched into
    torch's classes for the block and taken out again."""
    from torchvision.models import vision_transformer as tv

    pytest.importorskip("lxt", reason="lxt is a test dependency (pip install -e .[dev])")
    from lxt.efficient import monkey_patch
    from lxt.efficient.models.vit_torch import cp_LRP

    classes = [tv.nn.GELU, tv.nn.LayerNorm, tv.nn.MultiheadAttention]
    saved = {c: c.__dict__["forward"] for c in classes}
    try:
        monkey_patch(tv, cp_LRP)
        yield
    finally:
        for c, forward in saved.items():
            c.forward = forward
            if "original_forward" in c.__dict__:
                del c.original_forward


def test_attnlrp_equals_lxt_on_a_torchvision_vit():
    model, images, target = torchvision_vit(), torch.randn(2, 3, 32, 32), torch.tensor([1, 4])
    ours = attribute(model, images, "attnlrp", target)
    with lxt_cp_lrp():
        x = images.clone().requires_grad_(True)
        model(x)[torch.arange(2), target].sum().backward()
        reference = (x * x.grad).sum(dim=1)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())
    # the classes are whole again: a plain forward's gradient is not the LRP one
    plain = images.clone().requires_grad_(True)
    model(plain)[torch.arange(2), target].sum().backward()
    assert not torch.allclose((plain * plain.grad).sum(dim=1), reference, atol=1e-6)


def zero_additive_terms(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.rsplit(".", 1)[-1].endswith(ADDITIVE):
                t.zero_()
    return model


@pytest.mark.parametrize("name", [*ATTENTION_MODELS, "timm_vit", "torchvision_vit"])
def test_relevance_is_conserved_without_additive_terms(name):
    """With CP-LRP inside the attention the rules make the model linear in its input and its additive terms;
    with those zeroed the input's relevance is the whole logit (float rounding only)."""
    model = timm_vit() if name == "timm_vit" else torchvision_vit() if name == "torchvision_vit" else \
        zoo.create_model(name, img_size=32).eval() if name.startswith("vit") else zoo.create_model(name).eval()
    assert "attnlrp" in applicable_methods(model)
    zero_additive_terms(model)
    torch.manual_seed(1)
    images, target = torch.randn(2, 3, 32, 32), torch.tensor([3, 8])
    logits = model(images)[torch.arange(2), target].detach()
    relevance = attribute(model, images, "attnlrp", target)
    torch.testing.assert_close(relevance.sum(dim=(1, 2)), logits, rtol=1e-4, atol=1e-5 * logits.abs().max().item())


def test_rules_leave_the_forward_values_alone_and_are_removed_on_exit():
    model, images = zoo.create_model("hybrid_tiny").eval(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(images)
        with lrp_rules(model, "attnlrp"):
            during = model(images)
        after = model(images)
    torch.testing.assert_close(during, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, before)
    assert not any("forward" in vars(m) or "_attend" in vars(m) for m in model.modules())


@pytest.mark.parametrize("attention", ["cp", "attnlrp"])
def test_zoo_and_timm_attention_give_the_same_relevance(attention):
    model = zoo.create_model("vit_nano").eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)
    images, target = torch.randn(2, 3, 32, 32), torch.tensor([2, 5])
    ours = attribute(model, images, "attnlrp", target, attention=attention)
    theirs = attribute(vit_to_timm(model).eval(), images, "attnlrp", target, attention=attention)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())


def test_the_attnlrp_rule_inside_attention_differs_from_cp_and_is_linear_in_the_target():
    model = zoo.create_model("vit_nano").eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)
    images = torch.randn(2, 3, 32, 32)
    a, b = torch.tensor([1, 2]), torch.tensor([6, 7])
    full = attribute(model, images, "attnlrp", a, attention="attnlrp")
    assert (full - attribute(model, images, "attnlrp", a)).abs().max() > 1e-4 * full.abs().max()
    both = attribute(model, images, "attnlrp", lambda logits: logits.gather(1, a[:, None])[:, 0]
                     + logits.gather(1, b[:, None])[:, 0], attention="attnlrp")
    torch.testing.assert_close(both, full + attribute(model, images, "attnlrp", b, attention="attnlrp"),
                               rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match=r"attention must be one of \('cp', 'attnlrp'\), got 'soft'"):
        attribute(model, images, "attnlrp", attention="soft")


def test_the_rules_stay_finite_in_float16_where_float32_is():
    """Under fp16 autocast: GELU's rule at inputs that round to 0 in fp16 (0 / 0 unless its ratio is computed in
    fp32) and LayerNorm's statistics of activations whose square passes fp16's 65,504 (its variance overflows)."""
    from zoo.explain.lrp import _IdentityRule, _layer_norm

    x = torch.tensor([0.0, 1e-8, -2.0, 3.0], dtype=torch.float16, requires_grad=True)
    (grad,) = torch.autograd.grad(_IdentityRule.apply(torch.nn.functional.gelu, x).sum(), x)
    expected = torch.nn.functional.gelu(x.detach().float()) / (x.detach().float() + 1e-10)
    torch.testing.assert_close(grad.float(), expected, rtol=1e-3, atol=1e-3)
    norm = torch.nn.LayerNorm(2)
    wide = torch.tensor([[300.0, -300.0]])
    torch.testing.assert_close(_layer_norm(norm)(wide.half()).float(), norm(wide), rtol=1e-3, atol=1e-3)


def test_attnlrp_under_float16_autocast_matches_float32():
    torch.manual_seed(0)
    model = zoo.create_model("vit_nano").eval()
    images, target = torch.randn(2, 3, 32, 32), torch.tensor([3, 8])
    full = attribute(model, images, "attnlrp", target)
    with torch.autocast("cpu", torch.float16):
        half = attribute(model, images, "attnlrp", target)
    assert torch.isfinite(half).all()
    assert (half.float() - full).norm() / full.norm() < 0.01  # measured 0.001 (bf16: 0.008)
