"""The captum:NAME methods (zoo.explain.captum_methods) against Captum called directly on the same model and
input, and against integrated gradients' completeness (attributions sum to f(x) - f(baseline))."""

from __future__ import annotations

import pytest
import torch

import zoo
from zoo.explain.methods import attribute, check_methods

captum_attr = pytest.importorskip("captum.attr", reason="captum is a test dependency (pip install -e .[dev])")


@pytest.fixture(scope="module")
def model():
    model = zoo.create_model("vit_nano").eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)
    return model


def test_integrated_gradients_equals_captum_and_is_complete(model):
    images, target = torch.randn(2, 3, 32, 32), torch.tensor([3, 6])
    ours = attribute(model, images, "captum:IntegratedGradients", target, n_steps=64)
    direct = captum_attr.IntegratedGradients(model).attribute(images, target=target, n_steps=64)
    torch.testing.assert_close(ours, direct.sum(dim=1), rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # completeness against the model itself: sum A = f(x) - f(0) for the target logit
        gap = (model(images) - model(torch.zeros_like(images)))[torch.arange(2), target]
    torch.testing.assert_close(ours.sum(dim=(1, 2)), gap, rtol=0.03, atol=0.03 * gap.abs().max().item())


def test_integrated_gradients_runs_its_steps_a_batch_at_a_time(model):
    """Captum's default puts all n_steps x B images through one forward (12,800 at eval.py's batch of 256)."""
    sizes = []
    hook = model.patch_embed.register_forward_hook(lambda module, args, out: sizes.append(args[0].shape[0]))
    try:
        attribute(model, torch.randn(3, 3, 32, 32), "captum:IntegratedGradients", torch.tensor([1, 2, 3]), n_steps=8)
    finally:
        hook.remove()
    assert max(sizes) == 3 and sum(sizes) == 8 * 3  # 8 steps of 3 images


def test_occlusion_uses_the_perturbation_grid_and_callable_targets(model):
    images = torch.randn(1, 3, 32, 32)
    ours = attribute(model, images, "captum:Occlusion", torch.tensor([2]))
    with torch.no_grad():  # occluding cell (0, 0) of the 8 x 8 grid by hand: the drop of the logit
        hidden = images.clone()
        hidden[..., :4, :4] = 0
        drop = model(images)[0, 2] - model(hidden)[0, 2]
    # one window covers each element of the cell, which carries the drop: 3 x drop once channels are summed
    torch.testing.assert_close(ours[0, :4, :4], 3 * drop.expand(4, 4), rtol=1e-4, atol=1e-5)
    by_callable = attribute(model, images, "captum:Occlusion", lambda logits: logits[:, 2])
    torch.testing.assert_close(by_callable, ours)


def test_bad_captum_names_give_one_line(model):
    with pytest.raises(ValueError, match=r"unknown Captum attribution class 'IntegratedGradient'; close names: "
                                         r"IntegratedGradients"):
        attribute(model, torch.randn(1, 3, 32, 32), "captum:IntegratedGradient")
    with pytest.raises(ValueError, match="captum:LayerGradCam needs more than the model"):
        check_methods(model, ["captum:LayerGradCam"])
    with pytest.raises(ValueError, match="'cbam_gate' does not apply to VisionTransformer; the methods that apply: "):
        check_methods(model, ["attnlrp", "cbam_gate"])  # a ViT has no CBAM gate
