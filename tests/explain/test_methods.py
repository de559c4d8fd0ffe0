"""zoo.explain.methods against independent references: Grad-CAM against pytorch-grad-cam on the same layer,
Chefer et al. 2021's rule and vit-explain's gradient rollout against numbers worked by hand, and the class-specific
methods against a recomputation from the gradient of the target class's logit taken through need_weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

import zoo
from zoo.explain.methods import (
    CLASS_SPECIFIC,
    METHODS,
    applicable_methods,
    attribute,
    chefer_relevance,
    grad_weighted_rollout,
)

pytest.importorskip("pytorch_grad_cam", reason="grad-cam is a test dependency (pip install -e .[dev])")


def minmax(maps: torch.Tensor) -> torch.Tensor:
    flat = maps.flatten(1)
    low = flat.min(1, keepdim=True).values
    flat = flat - low
    return (flat / (flat.max(1, keepdim=True).values + 1e-7)).reshape(maps.shape)


@pytest.mark.parametrize("name,layer", [("resnet18_cbam", "layer4"), ("hybrid_tiny", "stem")])
@pytest.mark.parametrize("targets", [None, [3, 7]])
def test_gradcam_equals_pytorch_grad_cam(name, layer, targets):
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    model = zoo.create_model(name).eval()
    images = torch.randn(2, 3, 32, 32)
    target = None if targets is None else torch.tensor(targets)
    ours = attribute(model, images, "gradcam", target)  # default layer
    assert ours.shape[1:] == {"layer4": (4, 4), "stem": (4, 4)}[layer]  # both nets end on a 4x4 grid
    torch.testing.assert_close(ours, attribute(model, images, "gradcam", target, layer=layer))
    assert all(p.grad is None for p in model.parameters())
    with GradCAM(model, [model.get_submodule(layer)]) as cam:  # resizes with cv2 (bilinear, half-pixel centres)
        theirs = cam(images, None if targets is None else [ClassifierOutputTarget(c) for c in targets])
    upsampled = F.interpolate(minmax(ours)[:, None], size=(32, 32), mode="bilinear", align_corners=False)[:, 0]
    assert (minmax(upsampled) - minmax(torch.from_numpy(theirs))).abs().max() < 1e-5


@pytest.mark.parametrize("targets", [None, [3, 7]])
def test_gradcam_on_vit_equals_pytorch_grad_cam_with_reshape_transform(targets):
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    torch.manual_seed(0)
    model = zoo.create_model("vit_nano").eval()  # random init: 1 class token + an 8x8 grid
    images = torch.randn(2, 3, 32, 32)
    target = None if targets is None else torch.tensor(targets)
    ours = attribute(model, images, "gradcam", target)  # default layer: the last block's norm1
    assert ours.shape == (2, 8, 8) and ours.max() > 0

    def reshape_transform(tokens):  # the pytorch-grad-cam ViT tutorial's, class token dropped
        return rearrange(tokens[:, 1:], "b (h w) c -> b c h w", h=8)

    with GradCAM(model, [model.blocks[-1].norm1], reshape_transform=reshape_transform) as cam:
        theirs = cam(images, None if targets is None else [ClassifierOutputTarget(c) for c in targets])
    upsampled = F.interpolate(minmax(ours)[:, None], size=(32, 32), mode="bilinear", align_corners=False)[:, 0]
    assert (minmax(upsampled) - minmax(torch.from_numpy(theirs))).abs().max() < 1e-5


def test_gradcam_layer_errors():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()
    with pytest.raises(ValueError, match="none of the default layers"):
        attribute(model, torch.randn(1, 3, 32, 32), "gradcam")
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        attribute(zoo.create_model("resnet18").eval(), torch.randn(1, 3, 32, 32), "gradcam", layer="nope")


# Two layers, two heads, three tokens: attention maps and their gradients, small numbers to work by hand.
MAPS = [
    [[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]],
     [[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.4, 0.1, 0.5]]],
    [[[0.6, 0.2, 0.2], [0.0, 0.0, 1.0], [0.25, 0.25, 0.5]],
     [[0.2, 0.2, 0.6], [0.0, 1.0, 0.0], [0.75, 0.25, 0.0]]],
]
GRADS = [
    [[[1.0, -2.0, 0.0], [0.0, 2.0, 1.0], [-1.0, 1.0, 2.0]],
     [[0.0, 1.0, 0.0], [-1.0, 1.0, 0.0], [2.0, 0.0, -1.0]]],
    [[[2.0, 0.0, -1.0], [1.0, 1.0, 1.0], [0.0, 4.0, 2.0]],
     [[-1.0, 2.0, 1.0], [0.0, -1.0, 0.0], [1.0, 0.0, 0.0]]],
]


def as_tensors(layers):
    return [torch.tensor(layer)[None] for layer in layers]  # (1, 2, 3, 3) each


def test_chefer_rule_matches_numbers_worked_by_hand():
    # layer 1: clamp(G * A) per head, then mean over heads
    #   head 0: [[1, 0, 0], [0, 1, 0], [0, .3, 1]]   head 1: [[0, 1, 0], [0, .5, 0], [.8, 0, 0]]
    #   cam1 = [[.5, .5, 0], [0, .75, 0], [.4, .15, .5]]
    #   R1 = I + cam1 @ I = [[1.5, .5, 0], [0, 1.75, 0], [.4, .15, 1.5]]
    # layer 2: head 0: [[1.2, 0, 0], [0, 0, 1], [0, 1, 1]]   head 1: [[0, .4, .6], [0, 0, 0], [.75, 0, 0]]
    #   cam2 = [[.6, .2, .3], [0, 0, .5], [.375, .5, .5]]
    #   R2 = R1 + cam2 @ R1 = R1 + [[1.02, .695, .45], [.2, .075, .75], [.7625, 1.1375, .75]]
    expected = [[2.52, 1.195, 0.45], [0.2, 1.825, 0.75], [1.1625, 1.2875, 2.25]]
    got = chefer_relevance(as_tensors(MAPS), as_tensors(GRADS))
    torch.testing.assert_close(got[0], torch.tensor(expected))


def test_grad_rollout_matches_numbers_worked_by_hand():
    # vit-explain: mean over heads of G * A, then clamp at 0:
    #   layer 1: mean [[.5, .5, 0], [-.25, .75, 0], [.3, .15, .25]] -> [[.5, .5, 0], [0, .75, 0], [.3, .15, .25]]
    #   layer 2: mean [[.5, .2, .2], [0, -.5, .5], [.375, .5, .5]] -> [[.5, .2, .2], [0, 0, .5], [.375, .5, .5]]
    # then rollout's recursion; layer 1 alone: A' = rownorm(.5 A + .5 I) = [[.75, .25, 0], [0, 1, 0],
    #   [.15, .075, .625] / .85]
    layer1 = [[[0.5, 0.5, 0.0], [0.0, 0.75, 0.0], [0.3, 0.15, 0.25]]]
    layer2 = [[[0.5, 0.2, 0.2], [0.0, 0.0, 0.5], [0.375, 0.5, 0.5]]]
    expected = zoo.attention_rollout([torch.tensor(layer1)[None], torch.tensor(layer2)[None]], num_prefix_tokens=1)
    got = grad_weighted_rollout(as_tensors(MAPS), as_tensors(GRADS), num_prefix_tokens=1)
    torch.testing.assert_close(got, expected)
    first = torch.tensor([[0.75, 0.25, 0], [0, 1, 0], [0.15 / 0.85, 0.075 / 0.85, 0.625 / 0.85]])
    torch.testing.assert_close(grad_weighted_rollout(as_tensors(MAPS[:1]), as_tensors(GRADS[:1]))[0], first)


def reference_maps_and_grads(model, images, target):
    """An independent path to d y_target / d A: the zoo ViT's blocks re-run by hand, each attention with
    need_weights=True on the math backend (its returned weights are the ones its output is computed from)."""
    x = model.patch_embed(images)
    x = torch.cat([model.cls_token.expand(len(x), -1, -1), x], dim=1) + model.pos_embed
    maps = []
    for block in model.blocks:
        block.attn.backend = "math"
        out, weights = block.attn(block.norm1(x), need_weights=True)
        block.attn.backend = "auto"
        maps.append(weights)
        x = x + out
        x = x + block.mlp(block.norm2(x))
    logits = model.forward_head(model.norm(x))
    torch.testing.assert_close(logits, model(images), atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(logits[torch.arange(len(images)), target].sum(), maps)
    return [m.detach() for m in maps], grads


@pytest.mark.parametrize("method", ["chefer2021", "grad_rollout"])
def test_class_specific_methods_follow_the_target_logits_gradient(method):
    model = zoo.create_model("vit_nano").eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)
    images = torch.randn(2, 3, 32, 32)
    per_class = []
    for target in (torch.tensor([1, 2]), torch.tensor([5, 6])):
        maps, grads = reference_maps_and_grads(model, images, target)
        relevance = chefer_relevance(maps, grads) if method == "chefer2021" else grad_weighted_rollout(maps, grads)
        got = attribute(model, images, method, target)
        torch.testing.assert_close(got, relevance[:, 0, 1:].reshape(2, 8, 8), atol=1e-5, rtol=1e-4)
        per_class.append(got)
    assert (per_class[0] - per_class[1]).abs().max() > 1e-3  # another class, another map
    predicted = model(images).argmax(-1)
    torch.testing.assert_close(attribute(model, images, method), attribute(model, images, method, predicted))


def test_applicable_methods_and_shapes():
    images = torch.randn(2, 3, 32, 32)
    baselines = ["random", "centre", "edges"]
    expected = {"vit_nano": ["raw_attention", "rollout", "grad_rollout", "chefer2021", "attnlrp", "gradcam",
                             *baselines],
                "hybrid_tiny": list(METHODS), "resnet18_cbam": ["gradcam", "cbam_gate", *baselines],
                "resnet18": ["gradcam", *baselines]}
    for name, methods in expected.items():
        model = zoo.create_model(name).eval()
        assert applicable_methods(model) == methods
        for method in methods:
            heatmap = attribute(model, images, method)
            assert heatmap.dim() == 3 and len(heatmap) == 2 and heatmap.dtype == torch.float32
            assert torch.isfinite(heatmap).all() and (method == "attnlrp" or (heatmap >= 0).all())  # LRP: signed
    assert CLASS_SPECIFIC == {"grad_rollout", "chefer2021", "attnlrp", "gradcam"}


def test_attribute_rejects_bad_arguments():
    model = zoo.create_model("vit_nano").eval()
    images = torch.randn(2, 3, 32, 32)
    with pytest.raises(ValueError, match=r"method must be one of .*got 'lrp'"):
        attribute(model, images, "lrp")
    with pytest.raises(ValueError, match=r"target must be \(B=2,\) class indices in \[0, 10\), got \[1, 10\]"):
        attribute(model, images, "chefer2021", torch.tensor([1, 10]))
    with pytest.raises(ValueError, match="needs attention maps"):
        attribute(zoo.create_model("resnet18_cbam").eval(), images, "rollout")
