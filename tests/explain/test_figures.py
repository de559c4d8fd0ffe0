"""zoo.viz: every figure renders to a readable PNG with its labels, titles, class names and colour bars."""

from __future__ import annotations

import matplotlib.image
import numpy as np
import pytest
import torch

from zoo.explain import figures as viz

NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def texts(fig) -> set[str]:
    """Every title, axis label and tick label in the figure (colour bars included)."""
    found = {fig._suptitle.get_text()} if fig._suptitle is not None else set()
    for ax in fig.axes:
        found |= {ax.get_title(), ax.get_xlabel(), ax.get_ylabel()}
        found |= {t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()}
        found |= {t.get_text() for t in ax.texts}
    return found


def saved_png(fig, tmp_path, name="fig.png"):
    path = viz.save(fig, tmp_path / "sub" / name)
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and min(pixels.shape[:2]) > 100 and pixels.std() > 0.01  # not blank
    return pixels


def test_upsample_heatmap_is_bilinear_and_rescaled():
    heat = torch.tensor([[0.0, 2.0], [4.0, 6.0]])
    up = viz.upsample_heatmap(heat, (4, 4))
    assert up.shape == (4, 4) and up.min() == 0.0 and up.max() == 1.0
    np.testing.assert_allclose(up[0], [0.0, 1 / 12, 3 / 12, 4 / 12], atol=1e-6)  # align_corners=False weights
    assert (viz.upsample_heatmap(torch.ones(2, 2), (4, 4)) == 0).all()  # a constant map -> all zero, not NaN


def test_attention_grid_labels_every_layer_and_head(tmp_path):
    maps = [torch.rand(3, 17, 17).softmax(-1) for _ in range(2)]
    fig = viz.attention_grid_figure(maps, title="vit: image 0")
    found = texts(fig)
    assert {"layer 1, head 1", "layer 2, head 3", "query token", "key token", "vit: image 0"} <= found
    assert any("attention weight" in t for t in found)  # the colour bar
    saved_png(fig, tmp_path)
    with pytest.raises(ValueError, match=r"non-empty list of \(H, N, M\) tensors, got \[\(17, 17\)\]"):
        viz.attention_grid_figure([torch.rand(17, 17)])


def test_explanation_figure_panels_and_title(tmp_path):
    fig = viz.explanation_figure(torch.rand(3, 32, 32), true_name="cat", pred_name="dog",
                                 rollout=torch.rand(8, 8), cbam=[torch.rand(32, 32), torch.rand(8, 8)])
    found = texts(fig)
    assert "true: cat   predicted: dog (wrong)" in found
    panels = {"image", "attention rollout", "CBAM stage 1 (32x32)", "CBAM stage 2 (8x8)", "spatial gate"}
    assert panels <= found
    saved_png(fig, tmp_path)
    plain = viz.explanation_figure(torch.rand(3, 32, 32), true_name="cat", pred_name="cat")
    assert "true: cat   predicted: cat (correct)" in texts(plain)


def test_confusion_matrix_figure_names_both_axes(tmp_path):
    fig = viz.confusion_matrix_figure(torch.arange(100).reshape(10, 10), NAMES)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == NAMES
    assert [t.get_text() for t in ax.get_yticklabels()] == NAMES
    assert {"predicted class", "true class", "99", "images"} <= texts(fig)
    saved_png(fig, tmp_path)
    with pytest.raises(ValueError, match=r"\(C, C\) = \(10, 10\) for 10 class names, got \(3, 3\)"):
        viz.confusion_matrix_figure(torch.zeros(3, 3), NAMES)


def test_scatter_rollout_grid_and_deletion_figures(tmp_path):
    fig = viz.accuracy_throughput_figure(["vit_tiny", "resnet18"], [0.8, 0.9], [5000.0, 3000.0])
    assert {"vit_tiny", "resnet18", "test top-1 accuracy", "inference images/s"} <= texts(fig)
    saved_png(fig, tmp_path, "scatter.png")
    fig = viz.rollout_grid_figure(torch.rand(3, 3, 32, 32), {"vit": torch.rand(3, 8, 8), "cnn": None},
                                  captions=NAMES[:3])
    assert {"image", "vit", "cnn\n(no map)", "airplane"} <= texts(fig)
    saved_png(fig, tmp_path, "grid.png")
    result = {"fractions": [0.0, 0.5], "num_images": 4,
              "curves": {"rollout": [1.0, 0.25], "random": [1.0, 0.5]},
              "auc": {"rollout": 0.3125, "random": 0.375}}
    fig = viz.deletion_figure(result)
    labels = {t.get_text() for t in fig.axes[0].get_legend().get_texts()}
    assert labels == {"rollout (AUC 0.312)", "random (AUC 0.375)"}
    saved_png(fig, tmp_path, "deletion.png")


def test_faithfulness_curves_figure_has_a_panel_per_removal_and_metric(tmp_path):
    fractions = [0.0, 0.5, 1.0]
    band = ([0.9, 0.5, 0.1], [0.8, 0.4, 0.05], [1.0, 0.6, 0.15])
    bands = {(r, m): {"rollout": band, "random": band} for r in ("zero", "blur") for m in ("deletion", "insertion")}
    fig = viz.faithfulness_curves_figure(bands, fractions, title="vit_nano")
    assert len(fig.axes) == 4
    found = texts(fig)
    assert "deletion, blur removal (lower area = more faithful)" in found
    assert "fraction of 8x8 patches inserted, most important first" in found
    assert any("bootstrap 95% CI" in t for t in found)
    saved_png(fig, tmp_path)


def test_methods_grid_marks_min_max_scaling_and_has_absolute_colour_bars(tmp_path):
    images = torch.rand(3, 3, 32, 32)
    heatmaps = {"rollout": torch.rand(3, 8, 8) * 0.03, "gradcam": torch.rand(3, 8, 8) * 5}
    relative = viz.methods_grid_figure(images, heatmaps, captions=["cat", "dog", "ship"], title="m")
    assert "m (each map scaled min->max on its own)" in texts(relative)
    absolute = viz.methods_grid_figure(images, heatmaps, absolute=True)
    found = texts(absolute)
    assert "absolute colour scale per method" in found and {"rollout", "gradcam"} <= found
    bars = [ax for ax in absolute.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 2 and bars[0].get_ylim()[1] == pytest.approx(heatmaps["rollout"].max().item(), rel=1e-5)
    saved_png(absolute, tmp_path)


def test_a_figure_that_fails_to_render_leaves_the_saved_one(tmp_path):
    """save() writes beside the file and renames: a failure part-way leaves the old PNG whole and no stray file;
    a file named .svg is an SVG, as matplotlib's own savefig makes it."""
    path = viz.save(viz.confusion_matrix_figure(torch.eye(10, dtype=torch.long), NAMES), tmp_path / "m.png")
    before = path.read_bytes()
    fig = viz.confusion_matrix_figure(torch.ones(10, 10, dtype=torch.long), NAMES)

    def torn(f, **kwargs):
        f.write(b"\x89PNG partial")
        raise KeyboardInterrupt  # a run stopped while the figure was written

    fig.savefig = torn
    with pytest.raises(KeyboardInterrupt):
        viz.save(fig, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]
    svg = viz.save(viz.confusion_matrix_figure(torch.eye(10, dtype=torch.long), NAMES), tmp_path / "m.svg")
    assert "<svg" in svg.read_text()[:2000]
