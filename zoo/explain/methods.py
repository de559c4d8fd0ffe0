"""Explanation methods behind one interface: ``attribute(model, images, method, target)`` -> one heatmap per image,
larger = more important, for the zoo's models and for timm's and torchvision's ViTs alike.

- ``raw_attention``: the last layer's attention, heads averaged (class-token row, or the mean over the patch rows
  for average-pooled models), over the patch grid.
- ``rollout``: attention rollout (Abnar & Zuidema 2020, https://arxiv.org/abs/2005.00928), see ``rollout``.
- ``grad_rollout``: gradient-weighted rollout as in vit-explain (https://github.com/jacobgil/vit-explain): each
  layer's A becomes clamp(mean_heads(dy_c/dA * A), min=0) before the rollout recursion.
- ``chefer2021``: Chefer, Gur & Wolf, "Generic Attention-model Explainability", ICCV 2021
  (https://arxiv.org/abs/2103.15679): R = I, then per layer R += mean_heads(clamp(dy_c/dA * A, min=0)) @ R.
- ``gradcam``: Grad-CAM (Selvaraju et al. 2017, https://arxiv.org/abs/1610.02391) on a convolutional layer:
  relu(sum_k mean_hw(dy_c/dF_k) * F_k), at that layer's resolution (the zoo's CBAM-ResNet: ``layer4``; the
  hybrid: its ``stem``, the grid its attention sees); on a ViT, the output of the last block's first norm with
  the patch tokens laid out on the model's grid, prefix tokens dropped (``tokens_to_grid``).
- ``cbam_gate``: the last CBAM spatial gate (Woo et al. 2018, https://arxiv.org/abs/1807.06521).
- ``attnlrp``: AttnLRP (Achtibat et al., ICML 2024, https://arxiv.org/abs/2402.05602), input x gradient under
  its propagation rules, at the image resolution (signed); see ``lrp``.
- ``captum:NAME``: any Captum attribution class (Captum's ``NAME``), see ``captum``.
- Baselines (``BASELINES``), which any method must beat: ``random`` (uniform noise on the model's patch grid),
  ``centre`` (a fixed Gaussian blob in the middle of that grid: the centre prior of image datasets) and ``edges``
  (the Sobel gradient magnitude of the input, at the image resolution).

Class-specific methods (``CLASS_SPECIFIC``, and every ``captum:`` method) explain ``target``: per image a class
index (B,), whose logit y_c is explained (None: the predicted class), or a callable mapping the logits (B, K) to
one score per image (B,) (a multi-label sum, a margin), whose gradient is explained.
Images are normalised (B, 3, H, W); maps come back as float32 on the CPU, (B, gh, gw) or (B, h, w)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .eager import eager
from .lrp import attnlrp as _attnlrp
from .record import CLASS_ATTENTION, attention_modules, record_attention, spatial_gates
from .rollout import attention_rollout, fuse_heads, patch_grid, rollout_heatmap, token_layout

METHODS = ("raw_attention", "rollout", "grad_rollout", "chefer2021", "attnlrp", "gradcam", "cbam_gate", "random",
           "centre", "edges")
CLASS_SPECIFIC = frozenset({"grad_rollout", "chefer2021", "attnlrp", "gradcam"})
ATTENTION_METHODS = ("raw_attention", "rollout", "grad_rollout", "chefer2021", "attnlrp")
BASELINES = ("random", "centre", "edges")
CAPTUM_PREFIX = "captum:"
GRADCAM_LAYERS = ("layer4", "stem")  # tried in this order: the CBAM-ResNet's last stage, the hybrid's conv stem


def chefer_relevance(maps: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Chefer et al. 2021's relevance (B, N, N) from per-layer attention maps and their gradients (B, H, N, N),
    in forward order: R = I; R = R + mean_heads(clamp(grad * A, min=0)) @ R for each layer."""
    if len(maps) != len(grads) or not maps:
        raise ValueError(f"need one gradient per map and at least one map, got {len(maps)} maps, {len(grads)} grads")
    b, _, n, _ = maps[0].shape
    relevance = torch.eye(n, device=maps[0].device).expand(b, n, n)
    for weights, grad in zip(maps, grads, strict=True):
        cam = (grad.float() * weights.float()).clamp(min=0).mean(dim=1)
        relevance = relevance + cam @ relevance
    return relevance


def grad_weighted_rollout(maps: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], *,
                          discard_ratio: float = 0.0, num_prefix_tokens: int = 1) -> torch.Tensor:
    """vit-explain's gradient-weighted rollout (B, N, N): each layer fused to clamp(mean_heads(grad * A), min=0),
    then ``attention_rollout``'s recursion (A' = rownorm(0.5 * A + 0.5 * I), R = A_L' @ ... @ A_1')."""
    if len(maps) != len(grads) or not maps:
        raise ValueError(f"need one gradient per map and at least one map, got {len(maps)} maps, {len(grads)} grads")
    fused = [(g.float() * a.float()).mean(dim=1, keepdim=True).clamp(min=0) for a, g in zip(maps, grads, strict=True)]
    return attention_rollout(fused, "mean", discard_ratio, num_prefix_tokens)


def _target(logits: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """The class indices (B,) ``target`` names (None: the predicted class)."""
    if target is None:
        return logits.argmax(dim=-1)
    target = torch.as_tensor(target, device=logits.device).long().reshape(-1)
    if target.shape[0] != logits.shape[0] or not ((0 <= target) & (target < logits.shape[1])).all():
        raise ValueError(f"target must be (B={logits.shape[0]},) class indices in [0, {logits.shape[1]}), "
                         f"got {target.tolist()}")
    return target


def target_scores(logits: torch.Tensor, target) -> torch.Tensor:
    """Each image's explained score (B,): ``target(logits)`` for a callable, else the logit of the class
    ``target`` names (None: the predicted class). A callable that gives no (B,) tensor -> ValueError."""
    if callable(target):
        scores = target(logits)
        if not isinstance(scores, torch.Tensor) or scores.shape != logits.shape[:1]:
            raise ValueError(f"a target callable must map the logits (B={logits.shape[0]}, K) to one score per "
                             f"image (B,), got {getattr(scores, 'shape', type(scores).__name__)}")
        return scores
    return logits.gather(1, _target(logits, target)[:, None])[:, 0]


def _score(logits: torch.Tensor, target) -> torch.Tensor:
    """Sum over the batch of each image's target score (images do not interact in eval mode)."""
    return target_scores(logits, target).sum()


def _self_attention(maps: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The maps over the full token set (that of the last map); cross-attention and other sizes left out."""
    if not maps:
        raise ValueError("this method needs attention maps and the model recorded none")
    n = maps[-1].shape[-1]
    return [a for a in maps if a.shape[-2:] == (n, n)]


def _attention_heatmap(model: nn.Module, relevance: torch.Tensor) -> torch.Tensor:
    grid, prefix, pooling = token_layout(model, relevance.shape[-1])
    return rollout_heatmap(relevance, grid, prefix, pooling)


def _maps_and_grads(model: nn.Module, images: torch.Tensor, target) -> tuple[list, list]:
    """The self-attention maps of one forward pass and the gradients of the target logits with respect to them."""
    with torch.enable_grad(), record_attention(model, keep_graph=True) as rec:
        logits = model(images)
        maps = _self_attention(rec.maps)
        grads = torch.autograd.grad(_score(logits, target), maps)
    return [a.detach() for a in maps], [g.detach() for g in grads]


@torch.no_grad()
def _recorded(model: nn.Module, images: torch.Tensor):
    with record_attention(model, to_cpu=False) as rec:
        model(images)
    return rec


def raw_attention(model: nn.Module, images: torch.Tensor, target=None) -> torch.Tensor:
    maps = _recorded(model, images).maps
    if maps and maps[-1].shape[-2] == 1:  # class attention (CaiT): the class token's row is the whole map
        grid, prefix, _ = token_layout(model, maps[-1].shape[-1])
        return fuse_heads(maps[-1].float())[:, 0, prefix:].reshape(-1, *grid)
    return _attention_heatmap(model, fuse_heads(_self_attention(maps)[-1].float()))


def rollout(model: nn.Module, images: torch.Tensor, target=None, *, head_fusion: str = "mean",
            discard_ratio: float = 0.0) -> torch.Tensor:
    rec = _recorded(model, images)
    maps = _self_attention(rec.maps)
    return _attention_heatmap(model, attention_rollout(maps, head_fusion, discard_ratio, rec.num_prefix_tokens))


def grad_rollout(model: nn.Module, images: torch.Tensor, target=None, *, discard_ratio: float = 0.0) -> torch.Tensor:
    maps, grads = _maps_and_grads(model, images, target)
    _, prefix, _ = token_layout(model, maps[0].shape[-1])
    return _attention_heatmap(model, grad_weighted_rollout(maps, grads, discard_ratio=discard_ratio,
                                                           num_prefix_tokens=prefix))


def chefer2021(model: nn.Module, images: torch.Tensor, target=None) -> torch.Tensor:
    maps, grads = _maps_and_grads(model, images, target)
    return _attention_heatmap(model, chefer_relevance(maps, grads))


def _last_block_norm(model: nn.Module) -> nn.Module | None:
    """The first norm of a token model's last block (timm / zoo ``blocks[-1].norm1``, torchvision
    ``encoder.layers[-1].ln_1``): pytorch-grad-cam's ViT tutorial layer; None for a model without blocks."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        blocks = getattr(getattr(model, "encoder", None), "layers", None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)) or not len(blocks):
        return None
    norm = getattr(blocks[-1], "norm1", None)
    return norm if isinstance(norm, nn.Module) else getattr(blocks[-1], "ln_1", None)


def gradcam_layer(model: nn.Module, layer: str | nn.Module | None = None) -> nn.Module:
    """The layer Grad-CAM reads: a module, a submodule name, or None for the first of ``GRADCAM_LAYERS``, else
    (token models) the last block's first norm."""
    if isinstance(layer, nn.Module):
        return layer
    names = [layer] if layer is not None else [n for n in GRADCAM_LAYERS if isinstance(getattr(model, n, None),
                                                                                       nn.Module)]
    if not names:
        norm = _last_block_norm(model)
        if norm is not None:
            return norm
        raise ValueError(f"gradcam: {type(model).__name__} has none of the default layers {GRADCAM_LAYERS} "
                         "and no transformer blocks; pass layer= (a module or its name)")
    try:
        return model.get_submodule(names[0])
    except AttributeError:
        raise ValueError(f"gradcam: {type(model).__name__} has no submodule {names[0]!r}") from None


def tokens_to_grid(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """(B, N, C) tokens -> (B, C, gh, gw) over the model's patch grid (``patch_grid``, non-square included),
    the leading prefix tokens (class, register, distillation) dropped: pytorch-grad-cam's ``reshape_transform``."""
    grid = patch_grid(model)
    if grid is None:
        grid = token_layout(model, tokens.shape[1])[0]
    prefix = tokens.shape[1] - grid[0] * grid[1]
    if prefix < 0:
        raise ValueError(f"gradcam: {tokens.shape[1]} tokens do not cover the patch grid {grid}")
    return rearrange(tokens[:, prefix:], "b (gh gw) c -> b c gh gw", gh=grid[0])


def gradcam(model: nn.Module, images: torch.Tensor, target=None, *,
            layer: str | nn.Module | None = None) -> torch.Tensor:
    module, seen = gradcam_layer(model, layer), []
    handle = module.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        with torch.enable_grad():
            logits = model(images)
            if len(seen) != 1 or seen[0].dim() not in (3, 4):
                raise ValueError(f"gradcam: the layer must run once per forward and give (B, C, h, w) features "
                                 f"or (B, N, C) tokens, got {[tuple(t.shape) for t in seen]}")
            (grad,) = torch.autograd.grad(_score(logits, target), seen)
    finally:
        handle.remove()
    features = seen[0].detach()
    if features.dim() == 3:
        features, grad = tokens_to_grid(model, features), tokens_to_grid(model, grad)
    weights = grad.mean(dim=(2, 3), keepdim=True)
    return (weights * features).sum(dim=1).clamp(min=0)


def cbam_gate(model: nn.Module, images: torch.Tensor, target=None) -> torch.Tensor:
    gates = _recorded(model, images).cbam
    if not gates:
        raise ValueError("cbam_gate needs a CBAM spatial gate and the model ran none")
    return gates[-1][:, 0]


def attnlrp(model: nn.Module, images: torch.Tensor, target=None, *, attention: str = "cp") -> torch.Tensor:
    return _attnlrp(model, images, lambda logits: _score(logits, target), attention=attention)


def random(model: nn.Module, images: torch.Tensor, target=None, *, grid: tuple[int, int] | None = None,
           seed: int = 0) -> torch.Tensor:
    """Uniform noise on ``grid``, by default the model's patch grid (``patch_grid``; 8 x 8 without one)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(images.shape[0], *(grid or patch_grid(model) or (8, 8)), generator=generator)


def centre(model: nn.Module, images: torch.Tensor, target=None, *, grid: tuple[int, int] | None = None,
           sigma: float = 0.25) -> torch.Tensor:
    """exp(-d^2 / (2 s^2)) on ``grid`` (by default ``random``'s: the model's patch grid, 8 x 8 without one), d the
    distance of a cell's centre from the grid's centre and s = ``sigma`` x the shorter side, in cells: the same
    map for every image, 1 at the centre."""
    grid = grid or patch_grid(model) or (8, 8)
    rows, cols = (torch.arange(n, dtype=torch.float32) - (n - 1) / 2 for n in grid)
    distance2 = rows[:, None] ** 2 + cols[None, :] ** 2
    blob = torch.exp(-distance2 / (2 * (sigma * min(grid)) ** 2))
    return blob.expand(images.shape[0], *grid)


SOBEL_X = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])


def edges(model: nn.Module, images: torch.Tensor, target=None) -> torch.Tensor:
    """The Sobel gradient magnitude sqrt(sum_c gx_c^2 + gy_c^2) of the (normalised) input (B, H, W), each
    channel filtered with the 3x3 Sobel kernels (cross-correlation) after reflect padding by one pixel."""
    x = images.detach().float()
    kernels = torch.stack([SOBEL_X, SOBEL_X.T]).to(x.device)[:, None]  # (2, 1, 3, 3): d/dx, d/dy
    padded = F.pad(x.flatten(0, 1)[:, None], (1, 1, 1, 1), mode="reflect")
    grads = F.conv2d(padded, kernels).unflatten(0, x.shape[:2])  # (B, C, 2, H, W)
    return grads.pow(2).sum(dim=(1, 2)).sqrt()


_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "raw_attention": raw_attention, "rollout": rollout, "grad_rollout": grad_rollout, "chefer2021": chefer2021,
    "attnlrp": attnlrp, "gradcam": gradcam, "cbam_gate": cbam_gate, "random": random, "centre": centre,
    "edges": edges}


def applicable_methods(model: nn.Module) -> list[str]:
    """The methods of ``METHODS`` that apply to ``model``, in that order: the attention ones where it has
    attention modules (``raw_attention`` alone for class attention, CaiT), ``gradcam`` where it has a default
    Grad-CAM layer, ``cbam_gate`` where it has CBAM gates, and the baselines (``BASELINES``) always."""
    attention = attention_modules(model)
    found = set(ATTENTION_METHODS) if attention else set()
    if any(isinstance(m, CLASS_ATTENTION) for m in attention):
        found = {"raw_attention"}  # the class token's last map; the patch blocks never see it
    if any(isinstance(getattr(model, n, None), nn.Module) for n in GRADCAM_LAYERS) or (
            _last_block_norm(model) is not None):
        found.add("gradcam")
    if spatial_gates(model):
        found.add("cbam_gate")
    return [m for m in METHODS if m in found | set(BASELINES)]


def check_methods(model: nn.Module, methods: Sequence[str]) -> None:
    """ValueError (one line) unless every name is a method of ``METHODS`` that applies to ``model`` or a
    ``captum:NAME`` of a Captum class built from the forward function alone."""
    applicable = applicable_methods(model)
    for method in methods:
        if method.startswith(CAPTUM_PREFIX):
            from .captum_methods import captum_method

            captum_method(method.removeprefix(CAPTUM_PREFIX))
        elif method not in applicable:
            what = "is not a method" if method not in METHODS else f"does not apply to {type(model).__name__}"
            raise ValueError(f"{method!r} {what}; the methods that apply: {', '.join(applicable)}, or "
                             "captum:NAME (a Captum attribution class)")


def attribute(model: nn.Module, images: torch.Tensor, method: str, target: torch.Tensor | None = None,
              **options) -> torch.Tensor:
    """Heatmaps (B, gh, gw) or (B, h, w), float32 on the CPU, of ``method`` (one of ``METHODS``, or
    ``captum:NAME``) for ``model`` (in eval mode) on normalised ``images`` (B, C, H, W), explaining ``target``:
    class indices (B,) (None: the predicted class) or a callable logits (B, K) -> scores (B,); ignored by methods
    not in ``CLASS_SPECIFIC``. ``options`` go to the method: ``head_fusion``, ``discard_ratio`` (rollout),
    ``discard_ratio`` (grad_rollout), ``attention`` (attnlrp: "cp" or "attnlrp"), ``layer`` (gradcam), ``grid``,
    ``seed`` (random), ``grid``, ``sigma`` (centre), and a Captum method's ``attribute`` arguments. No
    parameter's ``.grad`` is touched. A compiled model (``torch.compile``, ``compile: regions``) is explained
    through its eager form: the same maps as the eager model."""
    if method.startswith(CAPTUM_PREFIX):
        from .captum_methods import captum_method

        function = captum_method(method.removeprefix(CAPTUM_PREFIX))
    elif method in _FUNCTIONS:
        function = _FUNCTIONS[method]
    else:
        raise ValueError(f"method must be one of {METHODS} or captum:NAME (a Captum attribution class), "
                         f"got {method!r}")
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        raise ValueError(f"images must be (B, C, H, W), got {getattr(images, 'shape', type(images).__name__)}")
    if method in ATTENTION_METHODS and method not in (usable := applicable_methods(model)):
        raise ValueError(f"{method} needs attention maps over every token and {type(model).__name__} records "
                         f"none (no attention, windowed or class attention); methods that apply: {', '.join(usable)}")
    with eager(model) as plain:  # hooks and recorded weights need the eager forward (zoo.explain.eager)
        return function(plain, images, target, **options).detach().float().cpu()
