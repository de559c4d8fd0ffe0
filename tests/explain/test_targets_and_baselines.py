"""Targets beyond a class index (a callable on the logits) for every gradient method, and the centre / edges
baselines against their formulas (a Gaussian written out, a Sobel filter as a hand-written convolution)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import zoo
from zoo.explain.methods import BASELINES, attribute, centre, edges

GRADIENT_METHODS = ["grad_rollout", "chefer2021", "attnlrp", "gradcam"]


@pytest.fixture(scope="module")
def hybrid():
    model = zoo.create_model("hybrid_tiny").eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)
    return model


def picked(classes: torch.Tensor):
    return lambda logits: logits.gather(1, classes[:, None])[:, 0]


@pytest.mark.parametrize("method", GRADIENT_METHODS)
def test_a_callable_that_picks_the_class_equals_the_index(hybrid, method):
    images, target = torch.randn(2, 3, 32, 32), torch.tensor([4, 9])
    torch.testing.assert_close(attribute(hybrid, images, method, picked(target)),
                               attribute(hybrid, images, method, target))


@pytest.mark.parametrize("method", ["attnlrp", "captum:InputXGradient"])
def test_a_sum_of_two_classes_is_the_sum_of_their_maps_for_linear_methods(hybrid, method):
    if method.startswith("captum"):
        pytest.importorskip("captum.attr", reason="captum is a test dependency (pip install -e .[dev])")
    images, a, b = torch.randn(2, 3, 32, 32), torch.tensor([1, 2]), torch.tensor([5, 7])
    both = attribute(hybrid, images, method, lambda logits: picked(a)(logits) + picked(b)(logits))
    torch.testing.assert_close(both, attribute(hybrid, images, method, a) + attribute(hybrid, images, method, b),
                               rtol=1e-4, atol=1e-6)


def test_a_callable_must_give_one_score_per_image(hybrid):
    with pytest.raises(ValueError, match=r"a target callable must map the logits \(B=2, K\) to one score per "
                                         r"image \(B,\), got torch.Size\(\[\]\)"):
        attribute(hybrid, torch.randn(2, 3, 32, 32), "chefer2021", lambda logits: logits.sum())


def test_centre_is_the_gaussian_written_out():
    maps = centre(None, torch.zeros(3, 3, 32, 32), grid=(8, 8))
    assert maps.shape == (3, 8, 8) and torch.equal(maps[0], maps[2])
    s = 0.25 * 8
    for i, j in [(0, 0), (3, 3), (3, 4), (7, 2)]:
        expected = math.exp(-((i - 3.5) ** 2 + (j - 3.5) ** 2) / (2 * s * s))
        assert maps[0, i, j].item() == pytest.approx(expected, rel=1e-6)
    peak = (maps[0] == maps[0].max()).nonzero().tolist()
    assert peak == [[3, 3], [3, 4], [4, 3], [4, 4]]  # the four cells around the centre of an even grid
    odd = centre(None, torch.zeros(1, 3, 32, 32), grid=(5, 7))
    assert odd.shape == (1, 5, 7) and odd[0].argmax().item() == 2 * 7 + 3 and odd.max().item() == 1.0


def test_edges_is_the_sobel_magnitude_by_hand():
    images = torch.randn(2, 3, 9, 11)
    x = F.pad(images, (1, 1, 1, 1), mode="reflect")
    sobel = [[-1, 0, 1], [-2, 0, 2], [-1, 0, 1]]
    gx = sum(sobel[u][v] * x[..., u:u + 9, v:v + 11] for u in range(3) for v in range(3))
    gy = sum(sobel[v][u] * x[..., u:u + 9, v:v + 11] for u in range(3) for v in range(3))
    torch.testing.assert_close(edges(None, images), (gx ** 2 + gy ** 2).sum(dim=1).sqrt())
    flat = torch.ones(1, 3, 8, 8)
    assert edges(None, flat).abs().max() == 0  # no edge in a constant image
    step = torch.zeros(1, 1, 8, 8)
    step[..., 4:] = 1
    assert edges(None, step)[0, 2].tolist() == [0, 0, 0, 4, 4, 0, 0, 0]  # a vertical step: |1 + 2 + 1| beside it


def test_baselines_apply_to_every_model():
    for name in ("vit_nano", "resnet18"):
        model = zoo.create_model(name).eval()
        for method in BASELINES:
            assert attribute(model, torch.randn(2, 3, 32, 32), method).shape[0] == 2
