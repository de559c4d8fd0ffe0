"""What ``eval.py --report RUN [RUN ...] --out DIR`` does: one self-contained ``report.html`` that compares models
side by side and opens offline (figures embedded as ``data:`` URIs, no script, no network), beside the files it
is built from:

- per model: test top-1 plain and with test-time augmentation (``zoo.models.tta.REPORTED_TTA``, the level README
  and the model cards report: mirror + one-pixel shifts) on as many test images as the leaderboard uses (or
  ``accuracy_images``), parameters, FLOPs, inference and training images/s on this machine (``zoo.bench.timing``,
  a short measurement), with the CPU's name and a note where the machine was busy (load average above its cores);
- the same test images under each model's rollout (where it has attention) and its most faithful method
  (``leaderboard.best_method``), one absolute colour scale per method; a constant map is said in words;
- the faithfulness leaderboard (``faithfulness_report``: faithfulness.csv / .md), one table per model, best method
  first in each column and marked, with CIs and p-values (``< 0.001``, else 3 significant digits), and the
  deletion / insertion curves.

metrics.json holds the per-model numbers of the first table, keyed by the model's label; every number in the
page carries its exact value in a ``data-value`` attribute, so a test can compare the page with the files."""

from __future__ import annotations

import base64
import html
import io
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ..atomic import atomic_write_json, atomic_write_text
from ..bench.timing import measure_inference, measure_training
from ..data.run_data import data_for_run
from ..models.registry import model_info
from ..models.tta import REPORTED_TTA, TTA_NAMES, tta_logits
from ..runtime.device import eval_device
from ..runtime.machine import machine_facts
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
from .methods import BASELINES, applicable_methods, attribute
from .progress import counted
from .report import evaluate

TTA = f"TTA: {TTA_NAMES[REPORTED_TTA]}"
MODEL_COLUMNS = (("params", "parameters"), ("flops", "FLOPs / image"), ("num_images", "test images"),
                 ("test_top1", "top-1"), ("test_top1_tta", f"top-1, {TTA}"),
                 ("inference_images_per_s", "inference images/s"), ("train_images_per_s", "training images/s"))
BOARD_COLUMNS = ("auc", "ci_low", "ci_high", "p_vs_random", "p_vs_rollout", "p_vs_baselines")
BOARD_TITLES = ("AUC", "CI low", "CI high", "p vs random", "p vs rollout", "p vs best baseline")


@torch.no_grad()
def tta_top1(model: torch.nn.Module, dm, *, progress: bool = True) -> float:
    """Test top-1 under the test-time augmentation the zoo reports (``tta_logits`` level ``REPORTED_TTA``) over
    ``dm``'s test split, counted as it goes (``progress``)."""
    device, correct, count = next(model.parameters()).device, 0, 0
    total = len(dm.test_dataset.labels)
    for images, labels in counted(dm.test_dataloader(), total=total, desc=f"testing with {TTA} ({total:,} images)",
                                  unit="images", size=lambda batch: len(batch[1]), enabled=progress):
        logits = tta_logits(model, dm.normalize(images.to(device)), REPORTED_TTA)
        correct += (logits.argmax(-1).cpu() == labels).sum().item()
        count += len(labels)
    return correct / count


def _png(fig) -> str:
    buffer = io.BytesIO()
    viz.literal_text(fig).savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def model_row(model: torch.nn.Module, dm, *, bench_batch: int = 64, bench_repeats: int = 3, label: str = "",
              progress: bool = True) -> dict:
    """The first table's numbers of one model on ``dm`` (set up for testing), each pass said (``progress``);
    ``load_average`` is the highest 1-minute load average seen around the speed measurement (``os.getloadavg``,
    None where there is none)."""
    def say(line: str) -> None:
        if progress:
            print(line, flush=True)

    say(f"{label}: accuracy on {len(dm.test_dataset.labels):,} test images, plain and with {TTA}")
    metrics, _ = evaluate(model, dm, progress_on=progress)
    tta = tta_top1(model, dm, progress=progress)
    info = model_info(model)
    shape = tuple(dm.test_dataset.images.shape[1:])
    say(f"{label}: measuring inference and training speed (batch {bench_batch}, {bench_repeats} repeats)")
    before = load_average()
    inference = measure_inference(model, shape, bench_batch, repeats=bench_repeats)
    training = measure_training(model, shape, bench_batch, num_classes=dm.num_classes, repeats=bench_repeats)
    loads = [x for x in (before, load_average()) if x is not None]
    return {"params": info["params"], "flops": info["flops"], "test_top1": metrics["test_top1"],
            "test_top1_tta": tta, "tta_level": REPORTED_TTA, "num_images": metrics["num_images"],
            "inference_images_per_s": inference, "train_images_per_s": training,
            "load_average": max(loads) if loads else None}


def load_average() -> float | None:
    """The 1-minute load average, None where the system has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def html_report(sources: Sequence[str | Path], out: str | Path, *, data_dir: str | None = None,
                num_images: int = 1000, grid_images: int = 6, accuracy_images: int | None = None,
                batch_size: int = 256, device: str | None = None, cache_dir: str | None = None,
                bench_repeats: int = 3, seed: int = 0, progress: bool = True) -> Path:
    """Write ``out``/report.html (and faithfulness.csv / .md, the figures, metrics.json) for ``sources`` (run
    directories, .ckpt files or ``pretrained:NAME``): the leaderboard on ``num_images`` test images, accuracy
    on a seeded subset of as many test images (or of ``accuracy_images``; at most the test split), ``grid_images``
    images in the map figures; every pass said on the console as it goes (``progress``). Returns the page's path.
    Bad sources / data -> ValueError before anything is written."""
    out = Path(out)
    accuracy_images = num_images if accuracy_images is None else accuracy_images
    rows = faithfulness_report(sources, out, data_dir=data_dir, num_images=num_images, grid_images=grid_images,
                               absolute_scale=True, batch_size=batch_size, device=device, cache_dir=cache_dir,
                               seed=seed, progress=progress)
    loaded = [load_source(s) for s in sources]
    model_labels = source_labels(sources, [meta["model_name"] for _, meta in loaded])
    numbers, sections = {}, []
    for source, label, (model, meta) in zip(sources, model_labels, loaded, strict=True):
        model.to(eval_device(device)).eval()
        if progress:
            print(f"{label}: reading a seeded subset of {accuracy_images:,} test images", flush=True)
        dm = data_for_run(meta, data_dir=data_dir, batch_size=batch_size, max_test_images=accuracy_images,
                             cache_dir=cache_dir)
        if str(source).startswith(PRETRAINED):
            dm.use_normalization(model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
        numbers[label] = model_row(model, dm, bench_repeats=bench_repeats, label=label, progress=progress)
        if progress:
            print(f"{label}: the figures of {grid_images} test images", flush=True)
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
    atomic_write_text(path, _page(numbers, rows, sections, measured_on(eval_device(device)),
                                  busy_note(numbers.values())))
    return path


def measured_on(device: torch.device) -> str:
    """The device the throughput ran on, in words: the GPU's name, else the CPU's name (/proc/cpuinfo's model
    name, ``zoo.runtime.machine.machine_facts``), its cores and torch's threads; torch's version."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        where = "Apple GPU (mps)"
    else:
        facts = machine_facts()
        where = f"{facts['cpu']}, {facts['cores']} cores, {torch.get_num_threads()} threads"
    return f"{where}, torch {torch.__version__}"


def busy_note(rows) -> str:
    """A sentence where the machine was busy while the speed was measured (a 1-minute load average above its
    cores: other processes took part of it, so the images/s are lower than on an idle machine), else ''."""
    cores = machine_facts()["cores"]
    loads = [r["load_average"] for r in rows if r.get("load_average") is not None]
    if not loads or max(loads) <= cores:
        return ""
    return (f"The machine was busy while the speed was measured (load average {max(loads):.1f} on {cores} cores): "
            "other processes shared it, so these images/s are lower than on an idle machine.")


def p_value(value: float) -> str:
    """A p-value as read: ``< 0.001`` below it, else 3 significant digits; '–' where there is none (NaN)."""
    if value is None or math.isnan(value):
        return "–"
    return "< 0.001" if value < 0.001 else f"{value:.3g}"


def _cell(value, key: str, shown: str) -> str:
    """A table cell showing ``shown``, the exact value in data-value (NaN: "nan"), data-key naming it."""
    exact = "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else repr(value)
    return f'<td data-key="{html.escape(key)}" data-value="{exact}">{html.escape(shown)}</td>'


def _number(value, key: str) -> str:
    """A table cell: the value shown rounded, its exact repr in data-value, data-key naming what it is."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return _cell(value, key, "–")
    return _cell(value, key, f"{value:,}" if isinstance(value, int) else f"{value:.4g}")


def ranked(rows: list[dict], model: str) -> list[tuple[tuple[str, str], list[dict]]]:
    """``model``'s rows per (metric, removal) column, best first (deletion: lowest AUC, insertion: highest),
    baselines ranked among the methods."""
    mine = [r for r in rows if r["model"] == model]
    columns = dict.fromkeys((r["metric"], r["removal"]) for r in mine)
    return [((metric, removal), sorted((r for r in mine if (r["metric"], r["removal"]) == (metric, removal)),
                                       key=lambda r: r["auc"] if metric == "deletion" else -r["auc"]))
            for metric, removal in columns]


def _board(rows: list[dict]) -> str:
    """One leaderboard table per model: per column (metric, removal) its methods best first, the best method
    (not a baseline) marked."""
    best = board.best_rows(rows)
    head = "".join(f"<th>{t}</th>" for t in ("rank", "method", "", *BOARD_TITLES))
    tables = []
    for model in dict.fromkeys(r["model"] for r in rows):
        body = []
        for (metric, removal), column in ranked(rows, model):
            better = "lower" if metric == "deletion" else "higher"
            body.append(f'<tr><th colspan="{3 + len(BOARD_COLUMNS)}" class="group">{metric}, {removal} removal '
                        f"({better} AUC = more faithful)</th></tr>")
            for rank, r in enumerate(column, start=1):
                key = f"{r['model']}|{r['method']}|{r['removal']}|{r['metric']}|"
                top = best.get((model, removal, metric)) is r
                mark = "best" if top else "baseline" if r["method"] in BASELINES else ""
                cells = "".join(_cell(r[c], key + c, p_value(r[c])) if c.startswith("p_") else _number(r[c], key + c)
                                for c in BOARD_COLUMNS)
                style = ' class="best"' if top else ""
                body.append(f"<tr{style}><td>{rank}</td><td>{html.escape(r['method'])}</td><td>{mark}</td>{cells}</tr>")
        count = next(r["num_images"] for r in rows if r["model"] == model)
        tables.append(f"<h3>{html.escape(model)} ({count} test images)</h3>"
                      f'<table class="leaderboard"><tr>{head}</tr>{"".join(body)}</table>')
    return "".join(tables)


def _page(numbers: dict[str, dict], rows: list[dict], sections: list[str], machine: str, busy: str = "") -> str:
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in MODEL_COLUMNS)
    model_rows = "".join(
        f"<tr><td>{html.escape(label)}</td>" + "".join(_number(n[key], f"{label}|{key}") for key, _ in MODEL_COLUMNS)
        + "</tr>" for label, n in numbers.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>zoo report</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:1400px}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #bbb;padding:3px 8px;text-align:right}}td:first-child{{text-align:left}}
th.group{{text-align:left;background:#eee}}tr.best td{{font-weight:bold;background:#e8f4e8}}
img{{max-width:100%;display:block;margin:0.5em 0}}</style></head><body>
<h1>Models side by side</h1>
<p>Accuracy on a seeded subset of the test split (fractions, on the number of test images shown; {TTA}: the mean of
the logits of the image and its mirror, averaged half and half with those of the image shifted by one pixel up-left
and down-right and their mirrors), parameters, forward FLOPs per image, and throughput measured briefly on this
machine ({html.escape(machine)}). {html.escape(busy)}</p>
<table id="models"><tr><th>model</th>{head}</tr>{model_rows}</table>
<h2>What the models look at</h2>
<p>The same test images, the true class explained by each model's attention rollout and by its most faithful
method, each method on one absolute colour scale; then the mean deletion / insertion curves with bootstrap bands.</p>
{"".join(sections)}
<h2>Faithfulness leaderboard</h2>
<p>AUC of the true class's probability as 8x8 patches are removed (deletion: lower is more faithful) or inserted
(insertion: higher is more faithful), mean over the images with a bootstrap 95% CI; each column's methods best first,
the best method that is not a baseline (random, centre, edges) marked; p: one-sided paired sign-flip test against
random, against rollout and against the best baseline.</p>
<div id="leaderboard">{_board(rows)}</div>
</body></html>
"""
