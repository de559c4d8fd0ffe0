"""What ``eval.py --faithfulness RUN [RUN ...] --out DIR`` does: for every run (a run directory or checkpoint
written by train.py, or ``pretrained:NAME`` for a model whose weights ship with the zoo), explain test images
spread evenly over the classes with every method that applies (``methods``), score each by deletion and insertion
under the chosen removals with CIs and the paired tests against random and rollout (``leaderboard``), and write
into ``out``:

- faithfulness.csv: ``leaderboard.COLUMNS``, one row per model x method x removal x metric;
- faithfulness.md: a table per model with the best method of each column marked, a flag on every method that
  does not beat the best of the baselines (random, centre, edges) with p < 0.01 in some column, and with ``sanity`` the
  model-randomisation check (``sanity``) as a table of rank correlations;
- faithfulness_curves_<model>.png: the mean curves with bootstrap bands; faithfulness_maps_<model>.png: the same
  test images explained by every method (absolute colour scale with ``absolute_scale``).

Every check (device, checkpoints, each run's data classes) comes before any image is decoded, and nothing is
written until every model is done."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from ..atomic import atomic_write_text
from ..data import ImageData
from ..data.run_data import data_for_run
from ..models.checkpoints import load_run, load_shipped
from ..runtime.console import markdown_table
from ..runtime.device import eval_device
from . import figures as viz
from . import leaderboard as board
from .methods import check_methods
from .perturbation import FRACTIONS, METRICS, REMOVALS
from .report import check_data_classes, check_out_dir
from .sanity import cascading_randomisation

DEFAULT_REMOVALS = ("zero",)  # blur and mean each add about the time of zero, ROAD ~2.5x it: the full grid ~5x
PRETRAINED = "pretrained:"


def balanced_test_images(dm: ImageData, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` uint8 test images and their labels (all the test split has, where it has fewer), the same
    number from every class (the first classes take one more where ``count`` does not divide evenly; a class
    with too few gives all it has and the others make up for it, so a subset missing a class still gives
    ``count``), evenly spaced within each class, grouped by class."""
    labels, picks = dm.test_dataset.labels, []
    available = [int((labels == c).sum()) for c in range(dm.num_classes)]
    wanted = [0] * dm.num_classes
    for _ in range(min(count, len(labels))):  # one image at a time to the next class that has one left
        c = min((c for c in range(dm.num_classes) if wanted[c] < available[c]), key=lambda c: wanted[c])
        wanted[c] += 1
    for c in range(dm.num_classes):
        index = (labels == c).nonzero()[:, 0]
        if wanted[c]:
            picks.append(index[torch.linspace(0, len(index) - 1, wanted[c]).round().long()])
    index = torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long)
    return dm.test_dataset.images[index], labels[index]


def load_source(source: str | Path):
    """(model, meta) of a run directory / .ckpt, or of ``pretrained:NAME``; bad ones -> ValueError."""
    source = str(source)
    return load_shipped(source.removeprefix(PRETRAINED)) if source.startswith(PRETRAINED) else load_run(source)


def source_labels(sources: Sequence, names: Sequence[str]) -> list[str]:
    """Each source's label: its model's name; where two share a name, with the source's file or folder name
    (``vit_nano (last.ckpt)``); where those are alike too, with the whole source."""
    short = [name if names.count(name) == 1 else f"{name} ({Path(str(source)).name})"
             for source, name in zip(sources, names, strict=True)]
    return [label if short.count(label) == 1 else f"{name} ({source})"
            for label, source, name in zip(short, sources, names, strict=True)]


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")


def faithfulness_report(sources: Sequence[str | Path], out: str | Path, *, data_dir: str | None = None,
                        num_images: int = 1000, methods: Sequence[str] | None = None,
                        removals: Sequence[str] = DEFAULT_REMOVALS,
                        sanity: bool = False, sanity_images: int = 100, grid_images: int = 6,
                        absolute_scale: bool = False, batch_size: int = 256, device: str | None = None,
                        cache_dir: str | None = None, seed: int = 0, progress: bool = True) -> list[dict]:
    """Everything ``eval.py --faithfulness`` does (see the module docstring); returns the CSV's rows. The sanity
    check runs on the first ``sanity_images`` of the images (spread over the classes too). A run given twice,
    an unknown removal, a bad checkpoint or data whose classes are not the run's -> ValueError. ``methods``:
    default every one that applies to each model (``captum:NAME`` ones included when named); the baselines are
    always scored."""
    out = Path(out)
    check_out_dir(out)
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    unknown = [r for r in removals if r not in REMOVALS]
    if unknown or not removals:
        raise ValueError(f"removals must be some of {REMOVALS}, got {list(removals)}")
    resolved = [str(s) if str(s).startswith(PRETRAINED) else str(Path(s).resolve()) for s in sources]
    twice = sorted({str(s) for s, r in zip(sources, resolved, strict=True) if resolved.count(r) > 1})
    if twice:
        raise ValueError(f"--faithfulness got the same run more than once: {', '.join(twice)}")
    device = eval_device(device)
    loaded = [load_source(s) for s in sources]
    for model, meta in loaded:  # every run's data and methods checked before any image is decoded
        check_data_classes(meta, data_dir)
        if methods is not None:
            check_methods(model, methods)
    model_labels = source_labels(sources, [meta["model_name"] for _, meta in loaded])
    rows, figures, sanity_found, counts = [], {}, {}, {}
    for source, label, (model, meta) in zip(sources, model_labels, loaded, strict=True):
        model.to(device).eval()
        if progress:
            print(f"{label}: reading the test images", flush=True)
        dm = data_for_run(meta, data_dir=data_dir, batch_size=batch_size, cache_dir=cache_dir)
        if str(source).startswith(PRETRAINED):  # normalised as the weights were trained
            dm.use_normalization(model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
        images, labels = balanced_test_images(dm, num_images)
        normalised = dm.normalize(images)
        counts[label] = len(images)
        print(f"{label}: explaining {len(images)} test images, removals {', '.join(removals)}", flush=True)
        heatmaps = board.method_heatmaps(model, normalised, labels, methods=methods, batch_size=batch_size,
                                         seed=seed, progress=progress)
        curves = board.faithfulness_curves(model, normalised, labels, heatmaps, removals=removals, metrics=METRICS,
                                     batch_size=batch_size, seed=seed, progress=progress)
        rows += board.rows_from_curves(curves, model_name=label, seed=seed)
        shown = torch.linspace(0, len(images) - 1, min(grid_images, len(images))).round().long()
        figures[f"faithfulness_curves_{_slug(label)}.png"] = viz.faithfulness_curves_figure(
            board.curve_bands(curves, seed=seed), FRACTIONS, title=f"{label}: {len(images)} test images")
        figures[f"faithfulness_maps_{_slug(label)}.png"] = viz.methods_grid_figure(
            images[shown].float() / 255, {m: h[shown] for m, h in heatmaps.items()}, absolute=absolute_scale,
            captions=[dm.class_names[i] for i in labels[shown]], title=f"{label}: the true class explained")
        if sanity:
            part = torch.linspace(0, len(images) - 1, min(sanity_images, len(images))).round().long()
            sanity_found[label] = cascading_randomisation(model, normalised[part], labels[part], list(heatmaps),
                                                          batch_size=batch_size, seed=seed, progress=progress)
        model.cpu()  # the device holds one scored model at a time
    if progress:
        print(f"writing faithfulness.csv, faithfulness.md and {len(figures)} figures into {out}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    board.write_csv(rows, out / "faithfulness.csv")
    atomic_write_text(out / "faithfulness.md", faithfulness_markdown(rows, counts, sanity_found))
    for file, fig in figures.items():
        viz.save(fig, out / file)
    return rows


def _cell(row: dict, best: bool) -> str:
    p = "" if math.isnan(row["p_vs_random"]) else f", p={row['p_vs_random']:.2g}"
    p += "" if math.isnan(row["p_vs_rollout"]) else f", p_rollout={row['p_vs_rollout']:.2g}"
    text = f"{row['auc']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]{p}"
    return f"**{text}** (best)" if best else text


def _flag(rows: list[dict]) -> str:
    """The flag cell of one method: the columns where it does not beat the best baseline with p < 0.01."""
    if all(math.isnan(r["p_vs_baselines"]) for r in rows):
        return "baseline"
    failed = [f"{r['metric']}, {r['removal']}" for r in rows if not r["p_vs_baselines"] < board.BEATS_BASELINES_P]
    return f"**not above baselines**: {'; '.join(failed)}" if failed else "ok"


def faithfulness_markdown(rows: list[dict], counts: dict[str, int], sanity: dict[str, dict] | None = None) -> str:
    """faithfulness.md: what the numbers are, then per model a table (rows: methods, columns: metric x removal)
    with the best method of each column in bold, its headline best method, and its sanity check if run."""
    lines = ["# Faithfulness of explanation methods", "",
             "Cells: AUC of the curve of the true class's softmax probability as 8x8 patches are removed in the "
             "order a method ranks them (deletion, most important first: lower = more faithful) or inserted into "
             "the fully removed image (insertion: higher = more faithful); mean over the test images (spread "
             "evenly over the classes) with its bootstrap 95% CI, p = a one-sided paired sign-flip test that "
             "the method beats random on the same images, and p_rollout = the same test against rollout (where "
             "the model has it). Bold: the best method (not a baseline) in its column. Flag: the columns where a "
             f"method does not beat the best of the baselines (random, a centred Gaussian, the input's Sobel "
             f"edges) with a paired p < {board.BEATS_BASELINES_P}.", ""]
    best = board.best_rows(rows)
    for model, count in counts.items():
        mine = [r for r in rows if r["model"] == model]
        columns = list(dict.fromkeys((r["metric"], r["removal"]) for r in mine))
        methods = list(dict.fromkeys(r["method"] for r in mine))
        cell = {(r["method"], r["metric"], r["removal"]): r for r in mine}
        lines += [f"## {model} ({count} test images)", "", *markdown_table(
            ["method", *(f"{m}, {r} removal" for m, r in columns), "flag"],
            [[method, *(_cell(cell[method, m, r], best.get((model, r, m)) is cell[method, m, r]) for m, r in columns),
              _flag([cell[method, m, r] for m, r in columns])] for method in methods])]
        top = board.best_method(rows, model)
        if top is not None:
            vs_rollout = "" if math.isnan(top["p_vs_rollout"]) else f", p vs rollout {top['p_vs_rollout']:.2g}"
            lines += ["", f"Best method: **{top['method']}** (deletion AUC {top['auc']:.3f} with {top['removal']} "
                      f"removal, p vs random {top['p_vs_random']:.2g}{vs_rollout})."]
        if sanity and model in sanity:
            lines += ["", *_sanity_table(sanity[model])]
        lines.append("")
    return "\n".join(lines)


def _sanity_table(found: dict) -> list[str]:
    layers = found["layers"]
    lines = [f"Sanity check (Adebayo et al. 2018, cascading randomisation, {found['num_images']} images): Spearman "
             "rank correlation of each method's maps with the trained model's, as the layers are re-initialised "
             "from the top down (each column: that layer and every one left of it). A method that explains the "
             "model falls towards 0; one that stays near 1 does not depend on those weights.", ""]
    rows = [[method, *("n/a" if math.isnan(v) else f"{v:.2f}" for v in values)]
            for method, values in found["spearman"].items()]
    return lines + markdown_table(["method", *layers], rows)
