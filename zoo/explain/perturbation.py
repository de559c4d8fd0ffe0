"""Faithfulness by perturbation, per image and with statistics: deletion (MoRF: remove the patches a heatmap ranks
highest first; a faithful map makes the class score fall fastest, lower AUC is better) and insertion (LeRF read
from the other end: start from the image with every patch removed and put back the highest-ranked patches
first, i.e. remove the least relevant first; higher AUC is better) (Petsiuk et al. 2018,
https://arxiv.org/abs/1806.07421), with a choice of what a removed pixel becomes:

- ``zero``: 0, the dataset mean of normalised images;
- ``mean``: the image's own per-channel mean;
- ``blur``: the image blurred with a Gaussian (``blur_sigma`` pixels);
- ``road``: ROAD's noisy linear imputation (Rong et al. 2022, https://arxiv.org/abs/2202.00449): removed pixels
  solve "each equals the weighted mean of its 8 neighbours" (weights 1/6 side, 1/12 diagonal, as in ROAD), known
  pixels held fixed, solved by batched conjugate gradients; then Gaussian noise (``road_noise``) is added to
  them. Fewer off-distribution artefacts than blanking, so less of the score drop is the model reacting to the
  removal itself.

The score is the softmax probability of the target class. Statistics over images: the mean AUC, a percentile
bootstrap 95% confidence interval, and a one-sided paired sign-flip (permutation) test that a method beats
random on the same images. Images are normalised (B, C, H, W); perturbations run batched."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms.functional import gaussian_blur

REMOVALS = ("zero", "blur", "mean", "road")
METRICS = ("deletion", "insertion")
FRACTIONS = tuple(i / 10 for i in range(11))
_ROAD_STENCIL = torch.tensor([[1 / 12, 1 / 6, 1 / 12], [1 / 6, 0.0, 1 / 6], [1 / 12, 1 / 6, 1 / 12]])


def _neighbours(x: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each pixel's in-image neighbours, every channel alone: (B, C, H, W) -> (B, C, H, W)."""
    c = x.shape[1]
    stencil = _ROAD_STENCIL.to(x)[None, None].expand(c, 1, 3, 3)
    return F.conv2d(x, stencil, padding=1, groups=c)


def road_impute(images: torch.Tensor, removed: torch.Tensor, *, noise: float = 0.01, iterations: int = 200,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """ROAD's noisy linear imputation. images (B, C, H, W); removed (B, 1, H, W) bool (True = impute).
    Solves d_i u_i - sum_j w_ij u_j = sum_k w_ik x_k over removed pixels i (j removed, k kept neighbours,
    d_i = sum of i's in-image neighbour weights) by conjugate gradients (symmetric positive definite where each
    hole touches a kept pixel; an image with every pixel removed becomes 0), then adds N(0, noise^2)."""
    m = removed.to(images.dtype).expand_as(images)
    degree = _neighbours(torch.ones_like(images))

    def operator(u: torch.Tensor) -> torch.Tensor:
        return m * (degree * u - _neighbours(m * u))

    rhs = m * _neighbours((1 - m) * images)
    u = torch.zeros_like(images)
    residual = rhs.clone()
    direction = residual.clone()
    rr = (residual * residual).sum(dim=(2, 3), keepdim=True)
    for step in range(iterations):
        if step % 10 == 0 and rr.max() < 1e-12:  # read on the host every 10th step: on a GPU each read waits
            break
        ad = operator(direction)
        alpha = rr / (direction * ad).sum(dim=(2, 3), keepdim=True).clamp(min=1e-30)
        u = u + alpha * direction
        residual = residual - alpha * ad
        rr_new = (residual * residual).sum(dim=(2, 3), keepdim=True)
        direction = residual + (rr_new / rr.clamp(min=1e-30)) * direction
        rr = rr_new
    if noise > 0:
        u = u + noise * torch.randn(u.shape, generator=generator, device="cpu").to(u)
    return images * (1 - m) + u * m


def remove(images: torch.Tensor, removed: torch.Tensor, removal: str, *, blur_sigma: float = 2.0,
           road_noise: float = 0.01, generator: torch.Generator | None = None) -> torch.Tensor:
    """``images`` (B, C, H, W) with the pixels where ``removed`` (B, 1, H, W) bool is True replaced by
    ``removal`` (one of ``REMOVALS``)."""
    if removal not in REMOVALS:
        raise ValueError(f"removal must be one of {REMOVALS}, got {removal!r}")
    if removal == "road":
        return road_impute(images, removed, noise=road_noise, generator=generator)
    if removal == "zero":
        fill = torch.zeros_like(images)
    elif removal == "mean":
        fill = images.mean(dim=(2, 3), keepdim=True).expand_as(images)
    else:
        size = 2 * round(3 * blur_sigma) + 1
        fill = gaussian_blur(images, [size, size], [blur_sigma, blur_sigma])
    return torch.where(removed, fill, images)


def _patch_order(heatmap: torch.Tensor, grid: int) -> torch.Tensor:
    """Patches of a ``grid`` x ``grid`` grid ranked by ``heatmap`` (B, gh, gw) resized by adaptive average
    pooling, most important first: (B, grid * grid)."""
    scores = F.adaptive_avg_pool2d(heatmap.float()[:, None], grid).flatten(1)
    return scores.argsort(dim=1, descending=True, stable=True)


@torch.no_grad()
def perturbation_curves(model: nn.Module, images: torch.Tensor, targets: torch.Tensor, heatmap: torch.Tensor, *,
                        metric: str = "deletion", removal: str = "zero", fractions: Sequence[float] = FRACTIONS,
                        grid: int = 8, batch_size: int = 256, seed: int = 0, **removal_options) -> torch.Tensor:
    """Per-image curves (B, F): the softmax probability of ``targets`` (B,) after removing, for each fraction f,
    the top f of the patches ``heatmap`` ranks (``metric="deletion"``), or all but the top f
    (``"insertion"``), with ``removal``. images: (B, C, H, W) normalised, H and W divisible by ``grid``."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    if images.dim() != 4 or images.shape[-2] % grid or images.shape[-1] % grid:
        raise ValueError(f"images must be (B, C, H, W) with H, W divisible by grid={grid}, got {tuple(images.shape)}")
    b, _, h, w = images.shape
    if heatmap.dim() != 3 or heatmap.shape[0] != b:
        raise ValueError(f"heatmap must be (B={b}, gh, gw), got {tuple(heatmap.shape)}")
    device = next(model.parameters()).device
    images, targets = images.to(device), targets.to(device)  # once: each batch gathers its images on the device
    order = _patch_order(heatmap.cpu(), grid)  # the masks are built on the host, from the rank of each patch
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(grid * grid).expand(b, -1))  # 0 = most important
    jobs = [(i, j) for i in range(b) for j in range(len(fractions))]
    generator = torch.Generator().manual_seed(seed)
    fill = None  # zero / mean / blur: what a removed pixel becomes depends on its image only, so made once
    if removal != "road":
        fill = remove(images, torch.ones(b, 1, h, w, dtype=torch.bool, device=device), removal, **removal_options)
    scores = torch.empty(b, len(fractions))
    for start in range(0, len(jobs), batch_size):
        index, column = (torch.tensor(t) for t in zip(*jobs[start:start + batch_size], strict=True))
        counts = torch.tensor([round(fractions[j] * grid * grid) for j in column.tolist()])
        top = rank[index] < counts[:, None]  # (n, grid * grid): among the top f
        removed = top if metric == "deletion" else ~top
        removed = removed.reshape(-1, 1, grid, grid).repeat_interleave(h // grid, 2).repeat_interleave(w // grid, 3)
        rows, removed = index.to(device), removed.to(device)
        if fill is None:
            perturbed = remove(images[rows], removed, removal, generator=generator, **removal_options)
        else:
            perturbed = torch.where(removed, fill[rows], images[rows])
        probs = model(perturbed).float().softmax(dim=-1)
        scores[index, column] = probs.gather(1, targets[rows][:, None])[:, 0].cpu()
    return scores


def auc(fractions: Sequence[float], curves: torch.Tensor) -> torch.Tensor:
    """Area under each curve (..., F) over ``fractions``, trapezoid rule."""
    return torch.trapezoid(curves, torch.tensor(fractions, dtype=curves.dtype, device=curves.device), dim=-1)


def bootstrap_ci(values: torch.Tensor, *, level: float = 0.95, num_resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of ``values`` (n,)."""
    generator = torch.Generator().manual_seed(seed)
    values = values.double().flatten()
    picks = torch.randint(len(values), (num_resamples, len(values)), generator=generator)
    means = values[picks].mean(dim=1)
    tail = (1 - level) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=means.dtype))
    return low.item(), high.item()


def paired_p_value(better: torch.Tensor, worse: torch.Tensor, *, num_permutations: int = 10000,
                   seed: int = 0) -> float:
    """One-sided paired sign-flip (permutation) test that ``better`` (n,) exceeds ``worse`` (n,) on average:
    under the null each paired difference is symmetric about 0, so its sign is a coin flip.
    p = (1 + #{flipped mean >= observed mean}) / (1 + num_permutations)."""
    diff = (better.double() - worse.double()).flatten()
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (num_permutations, len(diff)), generator=generator).double() * 2 - 1
    flipped = (signs * diff).mean(dim=1)
    observed = diff.mean()
    return ((1 + (flipped >= observed - 1e-12).sum()) / (1 + num_permutations)).item()


def paired_auc_p_value(fractions: Sequence[float], curves: torch.Tensor, baseline_curves: torch.Tensor, *,
                       metric: str, seed: int = 0) -> float:
    """One-sided paired sign-flip p (``paired_p_value``) that per-image ``curves`` (B, F) beat
    ``baseline_curves`` (B, F) of the same images by AUC: deletion -> lower wins, insertion -> higher."""
    method_auc, baseline_auc = auc(fractions, curves), auc(fractions, baseline_curves)
    better, worse = (baseline_auc, method_auc) if metric == "deletion" else (method_auc, baseline_auc)
    return paired_p_value(better, worse, seed=seed)


def faithfulness_summary(fractions: Sequence[float], curves: torch.Tensor, random_curves: torch.Tensor, *,
                         metric: str, seed: int = 0) -> dict:
    """{"auc", "ci_low", "ci_high", "p_vs_random", "num_images"} of per-image ``curves`` (B, F) against
    ``random_curves`` (B, F) on the same images: deletion -> lower AUC wins, insertion -> higher."""
    method_auc = auc(fractions, curves)
    low, high = bootstrap_ci(method_auc, seed=seed)
    return {"auc": method_auc.mean().item(), "ci_low": low, "ci_high": high,
            "p_vs_random": paired_auc_p_value(fractions, curves, random_curves, metric=metric, seed=seed),
            "num_images": len(method_auc)}
