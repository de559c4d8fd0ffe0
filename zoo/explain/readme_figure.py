"""The README's figure: the shipped models (``hybrid_tiny``, ``vit_nano``) explaining the same few test images,
one row per (model, method): each model's attention rollout and, where another method is more faithful for it
(the newest faithfulness leaderboard of each model in BENCHMARKS.md: AttnLRP for both), that method too. Each map
is for the true class and scaled min->max on its own; a pixel-level map (AttnLRP) is averaged over the 8 x 8
patches the faithfulness test removes.

    python -m zoo.explain.readme_figure --data-dir DATA --out docs/figure.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.nn.functional as F

from ..data.run_data import data_for_run
from ..models.checkpoints import load_shipped
from . import figures as viz
from .faithfulness_report import balanced_test_images
from .methods import attribute

# (shipped model, method) per row, in order; attnlrp is vit_nano's most faithful method, rollout hybrid_tiny's.
ROWS = (("hybrid_tiny", "rollout"), ("hybrid_tiny", "attnlrp"), ("vit_nano", "rollout"), ("vit_nano", "attnlrp"))


def readme_figure(data_dir: str | None, out: str | Path, *, num_images: int = 5, rows=ROWS, dpi: int = 80) -> Path:
    """Draw ``rows`` on ``num_images`` test images spread over the classes (the same images for every row) and
    save the PNG at ``out``. Bad data -> zoo.data.DataError; an unknown model or method -> ValueError."""
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    heatmaps, images, captions = {}, None, None
    for name, method in rows:
        model, meta = load_shipped(name)
        model.eval()
        dm = data_for_run(meta, data_dir=data_dir)
        dm.use_normalization(model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
        shown, labels = balanced_test_images(dm, num_images)
        if images is None:
            images, captions = shown, [dm.class_names[i] for i in labels]
        heat = attribute(model, dm.normalize(shown), method, labels)
        if heat.shape[-2:] == shown.shape[-2:]:  # a pixel map: over the 8 x 8 patches the faithfulness test removes
            heat = F.avg_pool2d(heat[:, None], kernel_size=heat.shape[-1] // 8)[:, 0]
        heatmaps[f"{name}\n{method}"] = heat
    fig = viz.methods_grid_figure(images.float() / 255, heatmaps, captions=captions,
                                  title="where the shipped models look")
    return viz.save(fig, out, dpi=dpi)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.explain.readme_figure", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", help="CIFAR-10 folder (default: ./data, CIFAR-10 downloaded there if missing)")
    p.add_argument("--out", default="docs/figure.png", help="the PNG to write")
    p.add_argument("--num-images", type=int, default=5, help="test images, spread over the classes")
    args = p.parse_args(argv)
    try:
        print(readme_figure(args.data_dir, args.out, num_images=args.num_images))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
