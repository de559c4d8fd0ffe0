"""Any Captum attribution class (https://captum.ai, ``pip install 'zoo[explain]'``) as a zoo explanation method:
``attribute(model, images, "captum:IntegratedGradients", target)`` (``eval.py --faithfulness ... --methods
captum:Occlusion``) builds ``captum.attr.NAME(forward)`` and returns its attributions summed over the channels,
(B, H, W) at the image resolution, so it is scored like the zoo's own methods.

``forward`` is the model, explaining the class index ``target`` (None: the predicted class), or
``target(model(x))`` where ``target`` is a callable (logits -> one score per image). Perturbation methods get
defaults on the 8 x 8 patch grid of the faithfulness tests (Occlusion: windows and strides of one cell;
FeatureAblation, ShapleyValueSampling, Lime, KernelShap: one feature per cell), and path methods
(IntegratedGradients) run their steps one batch of images at a time; options passed to ``attribute`` override
them. Classes that need more than the forward function (a layer, a neuron, a wrapped method) are refused."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable

import torch
from torch import nn

DEFAULT_GRID = 8  # cells per side: the perturbation grid of the faithfulness tests
PATCH_FEATURES = frozenset({"FeatureAblation", "ShapleyValueSampling", "Lime", "KernelShap"})


def _attribution_classes() -> dict[str, type]:
    import captum.attr as attr

    return {n: c for n, c in vars(attr).items()
            if isinstance(c, type) and issubclass(c, attr.Attribution) and not inspect.isabstract(c)}


def _needs_only_forward(cls: type) -> bool:
    required = [p for p in list(inspect.signature(cls.__init__).parameters.values())[2:]
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return not required


def _grid_defaults(name: str, images: torch.Tensor, attribute: Callable) -> dict:
    b, c, h, w = images.shape
    if "internal_batch_size" in inspect.signature(attribute).parameters:
        # the path's steps in forwards of one batch each (Captum's default: all n_steps x B images in one
        # forward and backward, tens of GB of activations at B = 256)
        return dict(internal_batch_size=b)
    cell = (max(h // DEFAULT_GRID, 1), max(w // DEFAULT_GRID, 1))
    if name == "Occlusion":
        # windows batched into one forward of about 256 images (Captum's default: one window per forward)
        return dict(sliding_window_shapes=(c, *cell), strides=(c, *cell), perturbations_per_eval=max(1, 256 // b))
    if name in PATCH_FEATURES:
        rows = torch.arange(h, device=images.device) // cell[0]
        cols = torch.arange(w, device=images.device) // cell[1]
        mask = rows[:, None] * (cols.max() + 1) + cols[None, :]
        return dict(feature_mask=mask.expand(b, 1, h, w))
    return {}


def captum_method(name: str) -> Callable[..., torch.Tensor]:
    """The zoo method (model, images, target, **options) -> (B, H, W) of Captum's ``name``. Captum missing, an
    unknown name (the message lists close ones) or a class that needs more than a forward function ->
    ValueError."""
    try:
        classes = _attribution_classes()
    except ImportError:
        raise ValueError(f"captum:{name} needs Captum: pip install 'zoo[explain]'") from None
    if name not in classes:
        close = difflib.get_close_matches(name, list(classes), n=4, cutoff=0.4)
        hint = f"close names: {', '.join(close)}" if close else f"e.g. {', '.join(sorted(classes)[:4])}"
        raise ValueError(f"unknown Captum attribution class {name!r}; {hint}")
    cls = classes[name]
    if not _needs_only_forward(cls):
        raise ValueError(f"captum:{name} needs more than the model to build (a layer, a neuron or a wrapped "
                         "method); use a class built from the forward function alone, e.g. IntegratedGradients")

    def method(model: nn.Module, images: torch.Tensor, target=None, **options) -> torch.Tensor:
        images = images.detach().requires_grad_(True)  # what Captum's gradient methods want (else it warns)
        if callable(target):
            forward, index = (lambda x: target(model(x))), None
        else:
            forward = model
            if target is None:
                with torch.no_grad():
                    target = model(images).argmax(dim=-1)
            index = torch.as_tensor(target, device=images.device).long().reshape(-1)
        explainer = cls(forward)
        defaults = _grid_defaults(name, images, explainer.attribute)
        attributions = explainer.attribute(images, target=index, **{**defaults, **options})
        return attributions.detach().sum(dim=1)
    return method
