"""The model-randomisation sanity check (Adebayo et al. 2018): rank correlation against scipy and hand-worked
ties, the layer order, and answers known in advance: re-drawn random maps do not correlate, class-agnostic
attention maps do not see the head while gradient methods change as soon as it is re-initialised, the CBAM gate of
the hybrid's stem changes only when the stem does, and the model passed in is left untouched."""

from __future__ import annotations

import math

import pytest
import torch

import zoo
from zoo.explain.sanity import cascading_randomisation, randomisation_units, rank, spearman


def test_rank_averages_ties():
    assert rank(torch.tensor([3.0, 1, 1, 2, 5, 5, 5])).tolist() == [4, 1.5, 1.5, 3, 6, 6, 6]


def test_spearman_equals_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    a, b = torch.randn(5, 6, 6).round(), torch.randn(5, 6, 6).round()  # many ties
    expected = [stats.spearmanr(a[i].flatten(), b[i].flatten())[0] for i in range(5)]
    torch.testing.assert_close(spearman(a, b), torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)
    assert spearman(a, a.exp()).tolist() == pytest.approx([1.0] * 5)  # monotone -> 1
    assert math.isnan(spearman(torch.ones(1, 4), torch.arange(4.0)[None]).item())  # constant map -> NaN


def test_units_run_from_the_head_down():
    model = zoo.create_model("vit_nano").eval()
    names = [name for name, _ in randomisation_units(model, torch.randn(1, 3, 32, 32))]
    assert names == ["head", "norm", *[f"blocks.{i}" for i in range(5, -1, -1)], "patch_embed",
                     "cls_token, pos_embed"]


def test_known_answers_on_an_untrained_hybrid():
    model = zoo.create_model("hybrid_tiny").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    images, labels = torch.randn(24, 3, 32, 32), torch.arange(24) % 10
    found = cascading_randomisation(model, images, labels, ["rollout", "chefer2021", "gradcam", "cbam_gate",
                                                             "random"])
    assert found["layers"][0] == "head" and found["layers"][-1].startswith("stem") and found["num_images"] == 24
    r = found["spearman"]
    assert all(len(v) == len(found["layers"]) for v in r.values())
    assert all(abs(v) < 0.15 for v in r["random"])  # re-drawn noise: no correlation
    assert r["rollout"][0] == pytest.approx(1.0)  # class-agnostic: the head does not enter it
    assert r["chefer2021"][0] < 0.9 and r["gradcam"][0] < 0.9  # gradients of the head's logit: change at once
    stem = [i for i, name in enumerate(found["layers"]) if name.startswith("stem")]
    assert all(v == pytest.approx(1.0) for v in r["cbam_gate"][:stem[0]])  # computed before the blocks
    assert r["cbam_gate"][-1] < 0.9
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
