"""What ``eval.py --report RUN [RUN ...] --out DIR`` does: one self-contained ``report.html`` that compares models
side by side and opens offline (figures embedded as ``data:`` URIs, no script, no network), beside the files it
is built from:

- per model: test top-1 plain and with test-time augmentation (mirror, ``zoo.train.tta`` level 1), parameters,
  FLOPs, inference and training images/s on this machine (``zoo.bench.timing``, a short measurement);
- the same test images under each model's rollout (where it has attention) and its most faithful method
  (``leaderboard.best_method``), one absolute colour scale per method; a constant map is said in words;
- the faithfulness leaderboard (``faithfulness_report``: faithfulness.csv / .md) with CIs and p-values, and the
  deletion / insertion curves.

metrics.json holds the per-model numbers of the first table, keyed by the model's label; every number in the
page carries its exact value in a ``data-value`` attribute, so a test can compare the page with the files."""

from __future__ import annotations

import base64
import html
import io
import math
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from ..atomic import atomic_write_json, atomic_write_text
from ..bench.timing import measure_inference, measure_training
from ..models.registry import model_info
from ..train.device import eval_device
from ..train.tta import tta_logits
from . import figures as viz
from . import leaderboard as board
from .faithfulness_report import (
    PRETRAINED,
    _slug,
    balanced_test_images,
    faithfulness_report,
    load_source,
    source_labels,
)
from .methods import applicable_methods, attribute
from .report import data_module_for, evaluate

MODEL_COLUMNS = (("params", "parameters"), ("flops", "FLOPs / image"), ("test_top1", "top-1"),
                 ("test_top1_tta", "top-1, TTA"), ("inference_images_per_s", "inference images/s"),
                 ("train_images_per_s", "training images/s"))
BOARD_COLUMNS = ("auc", "ci_low", "ci_high", "p_vs_random", "p_vs_rollout")


@torch.no_grad()
def tta_top1(model: torch.nn.Module, dm) -> float:
    """Test top-1 with the mirror test-time augmentation (``tta_logits`` level 1) over ``dm``'s test split."""
    device, correct, count = next(model.parameters()).device, 0, 0
    for images, labels in dm.test_dataloader():
        logits = tta_logits(model, dm.normalize(images.to(device)), 1)
        correct += (logits.argmax(-1).cpu() == labels).sum().item()
        count += len(labels)
    return correct / count


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _number(value, key: str) -> str:
    """A table cell: the value shown rounded, its exact repr in data-value, data-key naming what it is."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f'<td data-key="{html.escape(key)}" data-value="nan">–</td>'
    shown = f"{value:,}" if isinstance(value, int) else f"{value:.4g}"
    return f'<td data-key="{html.escape(key)}" data-value="{value!r}">{shown}</td>'


def model_row(model: torch.nn.Module, dm, *, bench_batch: int = 64, bench_repeats: int = 3) -> dict:
    """The first table's numbers of one model on ``dm`` (set up for testing)."""
    metrics, _ = evaluate(model, dm)
    info = model_info(model)
    shape = tuple(dm.test_dataset.images.shape[1:])
    return {"params": info["params"], "flops": info["flops"], "test_top1": metrics["test_top1"],
            "test_top1_tta": tta_top1(model, dm), "num_images": metrics["num_images"],
            "inference_images_per_s": measure_inference(model, shape, bench_batch, repeats=bench_repeats),
            "train_images_per_s": measure_training(model, shape, bench_batch, num_classes=dm.num_classes,
                                                   repeats=bench_repeats)}


def html_report(sources: Sequence[str | Path], out: str | Path, *, data_dir: str | None = None,
                num_images: int = 1000, grid_images: int = 6, accuracy_images: int | None = None,
                batch_size: int = 256, device: str | None = None, cache_dir: str | None = None,
                bench_repeats: int = 3, seed: int = 0, progress: bool = True) -> Path:
    """Write ``out``/report.html (and faithfulness.csv / .md, the figures, metrics.json) for ``sources`` (run
    directories, .ckpt files or ``pretrained:NAME``): the leaderboard on ``num_images`` test images, accuracy
    on the whole test split (or a seeded ``accuracy_images`` of it), ``grid_images`` images in the map figures.
    Returns the page's path. Bad sources / data -> ValueError before anything is written."""
    out = Path(out)
    rows = faithfulness_report(sources, out, data_dir=data_dir, num_images=num_images, grid_images=grid_images,
                               absolute_scale=True, batch_size=batch_size, device=device, cache_dir=cache_dir,
                               seed=seed, progress=progress)
    loaded = [load_source(s) for s in sources]
    model_labels = source_labels(sources, [meta["model_name"] for _, meta in loaded])
    numbers, sections = {}, []
    for source, label, (model, meta) in zip(sources, model_labels, loaded, strict=True):
        model.to(eval_device(device)).eval()
        dm = data_module_for(meta, data_dir=data_dir, batch_size=batch_size, max_test_images=accuracy_images,
                             cache_dir=cache_dir)
        if str(source).startswith(PRETRAINED):
            dm.use_normalization(model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
        print(f"{label}: accuracy and speed", flush=True)
        numbers[label] = model_row(model, dm, bench_repeats=bench_repeats)
        best = board.best_method(rows, label)
        shown = [m for m in ("rollout", best and best["method"]) if m and m in applicable_methods(model)]
        images, labels = balanced_test_images(dm, grid_images)
        normalised = dm.normalize(images).to(next(model.parameters()).device)
        maps = {m: attribute(model, normalised, m, labels) for m in dict.fromkeys(shown)}
        maps_png = _png(viz.methods_grid_figure(images.float() / 255, maps, absolute=True,
                                                captions=[dm.class_names[i] for i in labels],
                                                title=f"{label}: the true class explained"))
        curves = out / f"faithfulness_curves_{_slug(label)}.png"
        curves_uri = "data:image/png;base64," + base64.b64encode(curves.read_bytes()).decode("ascii")
        note = ("" if best is None else f"most faithful method: <b>{html.escape(best['method'])}</b> (deletion AUC "
                f"{best['auc']:.3f}, {html.escape(best['removal'])} removal)")
        sections.append(f"<h3>{html.escape(label)}</h3><p>{note}</p>"
                        f'<img alt="{html.escape(label)} maps" src="{maps_png}">'
                        f'<img alt="{html.escape(label)} curves" src="{curves_uri}">')
    atomic_write_json(out / "metrics.json", numbers)
    path = out / "report.html"
    atomic_write_text(path, _page(numbers, rows, sections, measured_on(eval_device(device))))
    return path


def measured_on(device: torch.device) -> str:
    """The device the throughput ran on, in words: the GPU's name, else the CPU and its threads; torch's version."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        where = "Apple GPU (mps)"
    else:
        cpu = " ".join(filter(None, (platform.machine(), platform.processor())))
        where = f"{cpu}, {torch.get_num_threads()} threads"
    return f"{where}, torch {torch.__version__}"


def _page(numbers: dict[str, dict], rows: list[dict], sections: list[str], machine: str) -> str:
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in MODEL_COLUMNS)
    model_rows = "".join(
        f"<tr><td>{html.escape(label)}</td>" + "".join(_number(n[key], f"{label}|{key}") for key, _ in MODEL_COLUMNS)
        + "</tr>" for label, n in numbers.items())
    board_head = "".join(f"<th>{c}</th>" for c in ("model", "method", "removal", "metric", *BOARD_COLUMNS, "images"))
    board_rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in ("model", "method", "removal", "metric"))
        + "".join(_number(r[c], f"{r['model']}|{r['method']}|{r['removal']}|{r['metric']}|{c}") for c in BOARD_COLUMNS)
        + f"<td>{r['num_images']}</td></tr>" for r in rows)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>zoo report</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:1400px}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #bbb;padding:3px 8px;text-align:right}}td:first-child{{text-align:left}}
img{{max-width:100%;display:block;margin:0.5em 0}}</style></head><body>
<h1>Models side by side</h1>
<p>Accuracy on the test split (fractions; TTA: the mean of the image's and its mirror's logits), parameters,
forward FLOPs per image, and throughput measured briefly on this machine ({html.escape(machine)}).</p>
<table id="models"><tr><th>model</th>{head}</tr>{model_rows}</table>
<h2>What the models look at</h2>
<p>The same test images, the true class explained by each model's attention rollout and by its most faithful
method, each method on one absolute colour scale; then the mean deletion / insertion curves with bootstrap bands.</p>
{"".join(sections)}
<h2>Faithfulness leaderboard</h2>
<p>AUC of the true class's probability as 8x8 patches are removed (deletion: lower is more faithful) or inserted
(insertion: higher is more faithful), mean over the images with a bootstrap 95% CI; p: one-sided paired sign-flip
test against random and against rollout.</p>
<table id="leaderboard"><tr>{board_head}</tr>{board_rows}</table>
</body></html>
"""
