"""Matplotlib figures for explaining and comparing models: heatmap overlays,
per-layer per-head attention grids, per-image explanation panels, confusion matrices, accuracy-vs-throughput
scatters, rollout grids across models, deletion curves (see zoo.explain), and the faithfulness leaderboard's
curves with bootstrap bands and its grid of the same images explained by every method. Built on
``matplotlib.figure.Figure`` directly: no pyplot, so no backend is chosen or switched and no display is needed.

Every ``*_figure`` function returns a ``matplotlib.figure.Figure``; ``save`` writes it as a PNG.
Images are (3, H, W) floats in [0, 1] (``ImageData.denormalize``); heatmaps are (gh, gw), any scale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize, PowerNorm
from matplotlib.figure import Figure
from matplotlib.text import Text

from ..atomic import atomic_write

HEATMAP_CMAP = "jet"


def _subplots(nrows: int = 1, ncols: int = 1, *, squeeze: bool = True, figsize=None, layout=None):
    """``plt.subplots`` without pyplot: a Figure that no backend or global figure list holds on to."""
    fig = Figure(figsize=figsize, layout=layout)
    return fig, fig.subplots(nrows, ncols, squeeze=squeeze)


def save(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG, or in the format the file's suffix names (parent folders created; atomically: a
    killed run leaves the old file). Returns the path."""
    path = Path(path)
    kind = path.suffix.lstrip(".").lower() or "png"
    literal_text(fig)
    atomic_write(path, lambda f: fig.savefig(f, format=kind, dpi=dpi, bbox_inches="tight"))
    return path


def literal_text(fig: Figure) -> Figure:
    """Every text of ``fig`` drawn as written: a class folder or a run named like mathtext (``$x$``) is its name,
    not a formula that matplotlib fails to parse when the figure is saved. Returns ``fig``."""
    for text in fig.findobj(Text):
        text.set_parse_math(False)
    return fig


def _image(image: torch.Tensor) -> np.ndarray:
    """(3, H, W) in [0, 1] -> (H, W, 3) numpy for imshow."""
    if image.dim() != 3 or image.shape[0] not in (1, 3):
        raise ValueError(f"image must be (C, H, W) with C = 1 or 3, got {tuple(image.shape)}")
    return image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy()


def upsample_heatmap(heatmap: torch.Tensor, size: tuple[int, int], *, rescale: bool = True) -> np.ndarray:
    """(gh, gw) heatmap -> (H, W) numpy, bilinearly upsampled and (``rescale``) rescaled to [0, 1] (min -> 0,
    max -> 1)."""
    if heatmap.dim() != 2:
        raise ValueError(f"heatmap must be (gh, gw), got {tuple(heatmap.shape)}")
    up = F.interpolate(heatmap.detach().float().cpu()[None, None], size=size, mode="bilinear",
                       align_corners=False)[0, 0]
    if not rescale:
        return up.numpy()
    span = up.max() - up.min()
    return ((up - up.min()) / span if span > 0 else torch.zeros_like(up)).numpy()


def constant_note(ax, image: torch.Tensor | None, heatmap: torch.Tensor, *, why: str | None = None) -> bool:
    """Where every value of ``heatmap`` is the same, draw ``image`` (or nothing) with a line saying so (and
    ``why``, where given) instead of a flat colour panel, which reads as a broken figure, and return True; else
    draw nothing, return False."""
    if heatmap.numel() and heatmap.max() > heatmap.min():
        return False
    if image is not None:
        ax.imshow(_image(image), alpha=0.35)
    note = f"constant map:\n{why}" if why else f"constant map:\nevery value {heatmap.flatten()[0].item():.3g}"
    ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", fontsize=8, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])
    return True


def overlay(ax, image: torch.Tensor, heatmap: torch.Tensor, *, alpha: float = 0.5, title: str | None = None):
    """Draw ``image`` with ``heatmap`` upsampled over it (rescaled to [0, 1] = least .. most important); a
    constant heatmap is said in words (``constant_note``)."""
    if title:
        ax.set_title(title, fontsize=9)
    if constant_note(ax, image, heatmap):
        return
    pixels = _image(image)
    ax.imshow(pixels)
    ax.imshow(upsample_heatmap(heatmap, pixels.shape[:2]), cmap=HEATMAP_CMAP, alpha=alpha, vmin=0, vmax=1)
    ax.set_xticks([])
    ax.set_yticks([])


def heatmap_colorbar(fig: Figure, ax, label: str = "relative importance (min..max)"):
    """The colour bar of ``overlay``'s [0, 1] heatmap scale, beside ``ax`` (one axes or an array of them)."""
    return fig.colorbar(ScalarMappable(Normalize(0, 1), HEATMAP_CMAP), ax=ax, fraction=0.046, pad=0.04,
                        label=label)


def attention_grid_figure(maps: Sequence[torch.Tensor], *, title: str = "attention weights") -> Figure:
    """Grid of every layer's (rows) and head's (columns) attention matrix for one image.
    maps: one (H, N, M) tensor per layer. Shared power-law colour scale, one colour bar."""
    if len(maps) == 0 or any(m.dim() != 3 for m in maps):
        raise ValueError(f"maps must be a non-empty list of (H, N, M) tensors, got "
                         f"{[tuple(m.shape) for m in maps]}")
    layers, heads = len(maps), max(m.shape[0] for m in maps)
    vmax = max(m.max().item() for m in maps)
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=vmax)
    fig, axes = _subplots(layers, heads, figsize=(1.9 * heads + 1.2, 1.9 * layers + 0.6), squeeze=False,
                             layout="constrained")
    shown = None
    for layer, weights in enumerate(maps):
        for head in range(heads):
            ax = axes[layer, head]
            if head >= weights.shape[0]:
                ax.axis("off")
                continue
            shown = ax.imshow(weights[head].detach().float().cpu().numpy(), cmap="viridis", norm=norm)
            ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=8)
            ax.tick_params(labelsize=6)
            if head == 0:
                ax.set_ylabel("query token", fontsize=7)
            if layer == layers - 1:
                ax.set_xlabel("key token", fontsize=7)
    fig.suptitle(title)
    fig.colorbar(shown, ax=axes, fraction=0.02, pad=0.02, label="attention weight (power-law scale)")
    return fig


def explanation_figure(image: torch.Tensor, *, true_name: str, pred_name: str,
                       rollout: torch.Tensor | None = None, cbam: Sequence[torch.Tensor] = ()) -> Figure:
    """One image explained: the image | the rollout overlaid (if any) | each CBAM stage's spatial gate (h, w)
    in [0, 1]. Titled with the true and predicted class."""
    panels = 1 + (rollout is not None) + len(cbam)
    fig, axes = _subplots(1, panels, figsize=(2.9 * panels, 3.0), squeeze=False, layout="constrained")
    axes = axes[0]
    axes[0].imshow(_image(image))
    axes[0].set_title("image", fontsize=9)
    axes[0].set_xticks([])
    axes[0].set_yticks([])
    col = 1
    if rollout is not None:
        overlay(axes[col], image, rollout, title="attention rollout")
        heatmap_colorbar(fig, axes[col])
        col += 1
    for stage, gate in enumerate(cbam, start=1):
        axes[col].set_title(f"CBAM stage {stage} ({gate.shape[0]}x{gate.shape[1]})", fontsize=9)
        if not constant_note(axes[col], None, gate, why=constant_gate_note(gate)):
            shown = axes[col].imshow(gate.detach().float().cpu().numpy(), cmap=HEATMAP_CMAP, vmin=0, vmax=1)
            axes[col].set_xticks([])
            axes[col].set_yticks([])
            axes[col].set_xlabel(gate_caption(gate), fontsize=7, wrap=True)
            fig.colorbar(shown, ax=axes[col], fraction=0.046, pad=0.04, label="spatial gate")
        col += 1
    verdict = "correct" if true_name == pred_name else "wrong"
    fig.suptitle(f"true: {true_name}   predicted: {pred_name} ({verdict})")
    return fig


def constant_gate_note(gate: torch.Tensor) -> str:
    """What a constant CBAM spatial gate does: the gate multiplies the stage's features by its value
    (``zoo.layers.cbam.SpatialAttention``), so all 1 passes them unchanged, all 0 blanks them."""
    value = gate.flatten()[0].item()
    if value >= 0.999:
        return "this stage's spatial gate\nis saturated (every value 1:\nit passes every feature\nunchanged)"
    if value <= 0.001:
        return "this stage's spatial gate\nis closed (every value 0:\nit blanks every feature)"
    return f"this stage's spatial gate\nscales every position alike\n(by {value:.3g}): no spatial\nselection"


def gate_caption(gate: torch.Tensor) -> str:
    """The caption of a CBAM spatial gate (h, w) in [0, 1]: the gate multiplies the stage's features, so it
    suppresses them where it is lower; said in words where it is lower in the centre, where a CIFAR object
    lies, than around it (the inner half of each side against the rest)."""
    caption = "gate x features: lower = suppressed"
    h, w = gate.shape
    if h >= 4 and w >= 4:
        centre = torch.zeros(h, w, dtype=torch.bool)
        centre[h // 4:h - h // 4, w // 4:w - w // 4] = True
        inside, outside = gate[centre].mean().item(), gate[~centre].mean().item()
        if inside < outside:
            caption += (f"\nlower in the centre ({inside:.2f}) than around it ({outside:.2f}):\nthis stage "
                        "suppresses the centre more than its surround")
    return caption


def confusion_matrix_figure(matrix: torch.Tensor, class_names: Sequence[str], *,
                            title: str = "confusion matrix") -> Figure:
    """(C, C) counts, rows = true class, columns = predicted class, with the count in each cell."""
    matrix = torch.as_tensor(matrix).detach().cpu()
    c = len(class_names)
    if matrix.shape != (c, c):
        raise ValueError(f"matrix must be (C, C) = ({c}, {c}) for {c} class names, got {tuple(matrix.shape)}")
    fig, ax = _subplots(figsize=(0.6 * c + 3, 0.6 * c + 2), layout="constrained")
    shown = ax.imshow(matrix.numpy(), cmap="Blues")
    ax.set_xticks(range(c), class_names, rotation=45, ha="right")
    ax.set_yticks(range(c), class_names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    threshold = matrix.max().item() / 2
    for i in range(c):
        for j in range(c):
            value = matrix[i, j].item()
            ax.text(j, i, f"{value:g}", ha="center", va="center", fontsize=7,
                    color="white" if value > threshold else "black")
    fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04, label="images")
    return fig


def accuracy_throughput_figure(names: Sequence[str], accuracy: Sequence[float],
                               throughput: Sequence[float], *,
                               throughput_label: str = "inference images/s") -> Figure:
    """Scatter of test top-1 (fraction) against throughput, one labelled point per model."""
    if not len(names) == len(accuracy) == len(throughput):
        raise ValueError(f"names, accuracy and throughput must have one entry per model, got lengths "
                         f"{len(names)}, {len(accuracy)}, {len(throughput)}")
    fig, ax = _subplots(figsize=(6, 4.5))
    ax.scatter(throughput, accuracy, s=40)
    for name, x, y in zip(names, throughput, accuracy, strict=True):
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=9)
    ax.set_xlabel(throughput_label)
    ax.set_ylabel("test top-1 accuracy")
    ax.set_title("accuracy vs throughput")
    ax.grid(alpha=0.3)
    ax.margins(0.2)
    return fig


def rollout_grid_figure(images: torch.Tensor, heatmaps: Mapping[str, torch.Tensor | None], *,
                        captions: Sequence[str] | None = None) -> Figure:
    """The same images (n, 3, H, W) in [0, 1] (columns) explained by several models (rows):
    heatmaps maps a model name to (n, gh, gw) (its rollout or CBAM map), or None (shown as the bare image)."""
    n = images.shape[0]
    rows = 1 + len(heatmaps)
    fig, axes = _subplots(rows, n, figsize=(1.8 * n + 1.2, 1.9 * rows), squeeze=False,
                             layout="constrained")
    any_map = False
    for col in range(n):
        ax = axes[0, col]
        ax.imshow(_image(images[col]))
        ax.set_xticks([])
        ax.set_yticks([])
        if captions is not None:
            ax.set_title(captions[col], fontsize=8)
        for row, (name, maps) in enumerate(heatmaps.items(), start=1):
            ax = axes[row, col]
            if maps is None:
                ax.imshow(_image(images[col]))
                ax.set_xticks([])
                ax.set_yticks([])
            else:
                overlay(ax, images[col], maps[col])
                any_map = True
            if col == 0:
                label = name.replace(" (", "\n(")  # "model (run-id)" on two lines
                ax.set_ylabel(label if maps is not None else f"{label}\n(no map)", fontsize=8)
    axes[0, 0].set_ylabel("image", fontsize=9)
    if any_map:
        heatmap_colorbar(fig, axes)
    fig.suptitle("what each model attends to (rollout, or CBAM gate for CNNs)")
    return fig


def deletion_figure(result: Mapping, *, title: str = "deletion test") -> Figure:
    """Top-1 against the fraction of patches blanked, one curve per ranking, AUC in the legend
    (``result`` as returned by zoo.explain.deletion_test)."""
    fig, ax = _subplots(figsize=(6, 4.5))
    for name, curve in result["curves"].items():
        ax.plot(result["fractions"], curve, marker="o", label=f"{name} (AUC {result['auc'][name]:.3f})")
    ax.set_xlabel("fraction of patches blanked (8x8 grid, most important first)")
    ax.set_ylabel("top-1 accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(f"{title} ({result['num_images']} images; lower AUC = more faithful)", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def faithfulness_curves_figure(bands: Mapping[tuple[str, str], Mapping[str, tuple]], fractions: Sequence[float], *,
                               title: str) -> Figure:
    """One panel per (removal, metric) (rows: removals, columns: metrics): for every method its mean curve of the
    true class's probability over the fraction of patches removed (deletion) or inserted (insertion), with its
    bootstrap 95% band. ``bands``: {(removal, metric): {method: (mean, low, high), each (F,)}}."""
    removals = list(dict.fromkeys(r for r, _ in bands))
    metrics = list(dict.fromkeys(m for _, m in bands))
    fig, axes = _subplots(len(removals), len(metrics), squeeze=False, layout="constrained",
                          figsize=(5.2 * len(metrics), 3.9 * len(removals)))
    for (removal, metric), by_method in bands.items():
        ax = axes[removals.index(removal), metrics.index(metric)]
        for method, (mean, low, high) in by_method.items():
            style = dict(color="0.4", linestyle="--") if method == "random" else {}
            line = ax.plot(fractions, mean, marker=".", label=method, **style)[0]
            ax.fill_between(fractions, low, high, color=line.get_color(), alpha=0.18, linewidth=0)
        what = "removed" if metric == "deletion" else "inserted"
        better = "lower" if metric == "deletion" else "higher"
        ax.set_xlabel(f"fraction of 8x8 patches {what}, most important first")
        ax.set_ylabel("probability of the true class")
        ax.set_ylim(0, 1)
        ax.set_title(f"{metric}, {removal} removal ({better} area = more faithful)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title} (bands: bootstrap 95% CI of the mean)")
    return fig


def methods_grid_figure(images: torch.Tensor, heatmaps: Mapping[str, torch.Tensor], *,
                        captions: Sequence[str] | None = None, absolute: bool = False, title: str = "") -> Figure:
    """The same images (n, 3, H, W) in [0, 1] (columns) explained by every method (rows; ``heatmaps``: {method:
    (n, gh, gw)}). ``absolute``: each method's maps drawn on one colour scale, from min(0, its smallest value) to
    its largest, shared by the images of its row, with its own colour bar; otherwise every map is scaled
    min->max on its own (said in the title): a flat map then looks as confident as a peaked one."""
    n = images.shape[0]
    rows = 1 + len(heatmaps)
    fig, axes = _subplots(rows, n, figsize=(1.8 * n + 1.8, 1.9 * rows), squeeze=False, layout="constrained")
    for col in range(n):
        axes[0, col].imshow(_image(images[col]))
        axes[0, col].set_xticks([])
        axes[0, col].set_yticks([])
        if captions is not None:
            axes[0, col].set_title(captions[col], fontsize=8)
    axes[0, 0].set_ylabel("image", fontsize=9)
    for row, (method, maps) in enumerate(heatmaps.items(), start=1):
        low, high = min(0.0, maps.min().item()), maps.max().item()
        shown = None
        for col in range(n):
            ax = axes[row, col]
            if absolute and constant_note(ax, images[col], maps[col]):
                continue
            if absolute:
                pixels = _image(images[col])
                ax.imshow(pixels)
                shown = ax.imshow(upsample_heatmap(maps[col], pixels.shape[:2], rescale=False), cmap=HEATMAP_CMAP,
                                  alpha=0.5, vmin=low, vmax=high if high > low else low + 1)
                ax.set_xticks([])
                ax.set_yticks([])
            else:
                overlay(ax, images[col], maps[col])
        axes[row, 0].set_ylabel(method, fontsize=9)
        if absolute and shown is not None:
            fig.colorbar(shown, ax=axes[row, :], fraction=0.02, pad=0.01, label=method)
    if not absolute:
        heatmap_colorbar(fig, axes[1:, :])
    scale = "absolute colour scale per method" if absolute else "each map scaled min->max on its own"
    fig.suptitle(f"{title} ({scale})" if title else scale)
    return fig
