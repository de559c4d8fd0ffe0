"""The model-randomisation sanity check of Adebayo et al. 2018, "Sanity Checks for Saliency Maps"
(https://arxiv.org/abs/1810.03292): re-initialise the model's layers one by one from the top (the head) down,
cumulatively, and after each step compare every method's maps with the maps of the trained model by Spearman rank
correlation. A method that explains the model must change as its weights are destroyed (correlation falling
towards 0); one that stays high is showing the input or the architecture, not what the model learnt.

"Layers" are the model's units in forward order: its top-level children, with ``nn.Sequential`` /
``nn.ModuleList`` children split into their items (a ViT's blocks, a ResNet stage's blocks), and the parameters
the model holds itself (class token, position embedding) as one unit that goes with the bottom. A unit is
re-initialised with each submodule's ``reset_parameters`` (Linear, conv, norms, BatchNorm statistics) and any
other parameter drawn from N(0, 0.02^2)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..runtime.random import forked_generators
from .methods import attribute


def rank(values: torch.Tensor) -> torch.Tensor:
    """Ranks (1-based, float64, on the CPU) along the last dimension of ``values`` (..., n), ties given their
    average rank."""
    flat = values.reshape(-1, values.shape[-1]).cpu().double()  # float64: on the CPU (MPS has none)
    rows, n = flat.shape
    sorted_values, order = flat.sort(dim=1, stable=True)
    new_group = torch.ones_like(sorted_values, dtype=torch.long)
    new_group[:, 1:] = (sorted_values[:, 1:] != sorted_values[:, :-1]).long()
    group = new_group.cumsum(dim=1) - 1 + torch.arange(rows)[:, None] * n  # a tie group id, unique per row
    position = torch.arange(1, n + 1, dtype=torch.float64).expand(rows, n).reshape(-1)
    average = torch.zeros(rows * n, dtype=torch.float64).scatter_reduce(0, group.reshape(-1), position, "mean",
                                                                       include_self=False)
    ranks = torch.empty_like(flat)
    ranks.scatter_(1, order, average[group].reshape(rows, n))
    return ranks.reshape(values.shape)


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation of each pair of maps: a, b (B, ...) -> (B,) (the Pearson correlation of their
    average ranks; NaN where either map is constant)."""
    if a.shape != b.shape or a.dim() < 2:
        raise ValueError(f"need two (B, ...) tensors of the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    ra, rb = rank(a.flatten(1)), rank(b.flatten(1))
    ra, rb = ra - ra.mean(dim=1, keepdim=True), rb - rb.mean(dim=1, keepdim=True)
    return (ra * rb).sum(dim=1) / (ra.norm(dim=1) * rb.norm(dim=1))


def randomisation_units(model: nn.Module, images: torch.Tensor) -> list[tuple[str, list[nn.Module | nn.Parameter]]]:
    """The model's units (name, [modules or parameters]) that hold parameters, top (last run) first."""
    units = {}
    for name, child in model.named_children():
        if isinstance(child, nn.Sequential | nn.ModuleList):
            units |= {f"{name}.{i}": m for i, m in child.named_children()}
        else:
            units[name] = child
    units = {n: m for n, m in units.items() if any(True for _ in m.parameters())}
    seen = []
    handles = [m.register_forward_pre_hook(lambda mod, args, name=n: seen.append(name)) for n, m in units.items()]
    try:
        with torch.no_grad():
            model(images[:1])
    finally:
        for handle in handles:
            handle.remove()
    order = list(dict.fromkeys(seen))
    found = [(name, [units[name]]) for name in reversed(order)]
    own = [(n, p) for n, p in model.named_parameters(recurse=False)]
    if own:
        found.append((", ".join(n for n, _ in own), [p for _, p in own]))
    return found


@torch.no_grad()
def _reinitialise(parts: Sequence[nn.Module | nn.Parameter]) -> None:
    for part in parts:
        if isinstance(part, nn.Parameter):
            nn.init.normal_(part, std=0.02)
            continue
        covered = set()
        for module in part.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
                covered |= {id(p) for p in module.parameters()}
        for p in part.parameters():
            if id(p) not in covered:
                nn.init.normal_(p, std=0.02)


def cascading_randomisation(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                            methods: Sequence[str], *, batch_size: int = 256, seed: int = 0,
                            progress: bool = False) -> dict:
    """Adebayo et al.'s cascading randomisation of a copy of ``model`` (eval mode; the model itself is not
    changed) on normalised ``images`` (B, C, H, W), every method explaining ``labels`` (B,).
    ``random``'s maps are re-drawn with a new seed at every step.

    Returns {"layers": [unit names, top first: step k has units 0..k re-initialised], "num_images",
    "spearman": {method: [mean over images of the rank correlation with the trained model's maps, per step]}}
    (NaN correlations, from constant maps, are left out of the mean)."""
    randomised = copy.deepcopy(model).eval()
    device = next(model.parameters()).device

    def maps(net: nn.Module, method: str, step: int) -> torch.Tensor:
        options = {"seed": seed + step} if method == "random" else {}
        return torch.cat([attribute(net, images[i:i + batch_size].to(device), method,
                                    labels[i:i + batch_size].to(device), **options)
                          for i in range(0, len(images), batch_size)])

    original = {method: maps(model, method, 0) for method in methods}
    units = randomisation_units(randomised, images.to(device))
    found = {method: [] for method in methods}
    with forked_generators(device, seed):
        for step, (_, parts) in enumerate(tqdm(units, desc="randomising", unit="layer", disable=not progress,
                                               leave=False), start=1):
            _reinitialise(parts)
            for method in methods:
                found[method].append(spearman(original[method], maps(randomised, method, step)).nanmean().item())
    return {"layers": [name for name, _ in units], "num_images": len(images), "spearman": found}
