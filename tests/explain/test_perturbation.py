"""zoo.explain.perturbation against known answers: ROAD's imputation against a dense linear solve and a linear
ramp it must reproduce, deletion / insertion curves that start and end at the full image's score, and a model
whose answer lives in one known region: the map of that region beats random with p < 0.01 under every removal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zoo.explain.perturbation import (
    FRACTIONS,
    REMOVALS,
    auc,
    bootstrap_ci,
    faithfulness_summary,
    paired_p_value,
    perturbation_curves,
    remove,
    road_impute,
)


class RegionModel(nn.Module):
    """Class 0's logit is 4 x the mean of channel 0 over the top-left 8x8 pixels (the 2x2 patches at the
    top-left of an 8x8 grid on 32x32 images); class 1's is 0."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(4.0))

    def forward(self, images):
        region = images[:, 0, :8, :8].mean(dim=(1, 2))
        return torch.stack([self.scale * region, torch.zeros_like(region)], dim=1)


def region_images(n=64):
    images = torch.randn(n, 3, 32, 32)
    images[:, :, :8, :8] += 2.0
    return images


def true_map(n=64):
    heatmap = torch.zeros(n, 8, 8)
    heatmap[:, :2, :2] = 1.0
    return heatmap + 1e-3 * torch.rand(n, 8, 8)  # ties broken at random outside the region


def test_road_imputation_equals_a_dense_linear_solve():
    images = torch.randn(1, 1, 6, 6)
    removed = torch.zeros(1, 1, 6, 6, dtype=torch.bool)
    removed[0, 0, 1:4, 2:5] = True
    removed[0, 0, 5, 0] = True
    got = road_impute(images, removed, noise=0.0)
    # the reference: one equation per removed pixel, u_i = sum_j w_ij x_j / sum_j w_ij over in-image neighbours
    idx = [(i, j) for i in range(6) for j in range(6) if removed[0, 0, i, j]]
    pos = {p: k for k, p in enumerate(idx)}
    a, b = torch.zeros(len(idx), len(idx), dtype=torch.float64), torch.zeros(len(idx), dtype=torch.float64)
    for k, (i, j) in enumerate(idx):
        for di in (-1, 0, 1):
            for dj in (-1, 0, 1):
                y, x = i + di, j + dj
                if (di, dj) == (0, 0) or not (0 <= y < 6 and 0 <= x < 6):
                    continue
                w = 1 / 6 if di == 0 or dj == 0 else 1 / 12
                a[k, k] += w
                if (y, x) in pos:
                    a[k, pos[(y, x)]] -= w
                else:
                    b[k] += w * images[0, 0, y, x].double()
    solved = torch.linalg.solve(a, b)
    expected = images.clone()
    for k, (i, j) in enumerate(idx):
        expected[0, 0, i, j] = solved[k].float()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert torch.equal(got[~removed.expand_as(got)], images[~removed.expand_as(images)])


def test_road_reproduces_a_linear_ramp_and_adds_its_noise():
    ramp = torch.linspace(-1, 1, 16)[None, None, None].expand(2, 3, 16, 16) + torch.linspace(0, 2, 16)[:, None]
    removed = torch.zeros(2, 1, 16, 16, dtype=torch.bool)
    removed[:, :, 3:12, 4:10] = True
    torch.testing.assert_close(road_impute(ramp, removed, noise=0.0), ramp, atol=1e-4, rtol=0)
    noisy = road_impute(ramp, removed, noise=0.5, generator=torch.Generator().manual_seed(0))
    assert 0.4 < (noisy - ramp)[removed.expand_as(ramp)].std() < 0.6
    everything = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    assert road_impute(ramp, everything, noise=0.0).abs().max() == 0  # nothing left to impute from: the mean


@pytest.mark.parametrize("removal", REMOVALS)
def test_remove_changes_only_removed_pixels(removal):
    images = torch.randn(3, 3, 16, 16)
    removed = torch.rand(3, 1, 16, 16) < 0.3
    out = remove(images, removed, removal)
    keep = ~removed.expand_as(images)
    assert torch.equal(out[keep], images[keep]) and not torch.equal(out, images)


@pytest.mark.parametrize("removal", REMOVALS)
def test_curves_start_and_end_at_the_full_image_score(removal):
    model = RegionModel()
    images = region_images(8)
    targets = torch.zeros(8, dtype=torch.long)
    full = model(images).softmax(-1)[:, 0]
    heatmap = torch.rand(8, 8, 8)
    deletion = perturbation_curves(model, images, targets, heatmap, metric="deletion", removal=removal,
                                   batch_size=20)
    insertion = perturbation_curves(model, images, targets, heatmap, metric="insertion", removal=removal,
                                    batch_size=7)
    assert deletion.shape == insertion.shape == (8, len(FRACTIONS))
    torch.testing.assert_close(deletion[:, 0], full)
    torch.testing.assert_close(insertion[:, -1], full)
    assert auc(FRACTIONS, torch.ones(2, len(FRACTIONS))).tolist() == [1.0, 1.0]


# ROAD's imputation is checked against a dense linear solve above; its 64-image run here is the slowest removal
@pytest.mark.parametrize("removal", [pytest.param(r, marks=pytest.mark.slow) if r == "road" else r for r in REMOVALS])
@pytest.mark.parametrize("metric", ["deletion", "insertion"])
def test_the_true_region_beats_random_with_p_below_001(metric, removal):
    model = RegionModel()
    images = region_images()
    targets = torch.zeros(64, dtype=torch.long)
    kwargs = dict(metric=metric, removal=removal, batch_size=128)
    truth = perturbation_curves(model, images, targets, true_map(), **kwargs)
    random = perturbation_curves(model, images, targets, torch.rand(64, 8, 8), **kwargs)
    summary = faithfulness_summary(FRACTIONS, truth, random, metric=metric)
    reverse = faithfulness_summary(FRACTIONS, random, truth, metric=metric)
    assert summary["p_vs_random"] < 0.01 and reverse["p_vs_random"] > 0.99
    assert summary["ci_low"] <= summary["auc"] <= summary["ci_high"] and summary["num_images"] == 64
    random_auc = auc(FRACTIONS, random).mean().item()
    assert summary["auc"] < random_auc if metric == "deletion" else summary["auc"] > random_auc


def test_statistics_on_known_samples():
    values = torch.randn(400) + 3.0
    low, high = bootstrap_ci(values)
    mean, sem = values.mean().item(), values.std().item() / 20
    assert low < mean < high and abs((high - low) - 2 * 1.96 * sem) < 0.3 * (high - low)
    noise = torch.randn(100)
    assert paired_p_value(noise + 1.0, noise) < 1e-3  # always better by 1
    assert paired_p_value(noise, noise + 1.0) > 0.999
    p = paired_p_value(torch.randn(100), torch.randn(100))  # no difference: p is not small
    assert 0.01 < p < 0.99
