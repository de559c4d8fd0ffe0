"""What ``eval.py --compare RUN [RUN ...]`` does: several trained runs side by side (whether each finished, params,
FLOPs, test top-1 and on how many test images, speed, the deletion test, each run's best explanation method) in
compare.md / compare.csv, an accuracy-vs-throughput scatter and the same test images explained by each run. What a
run's eval/ folder already holds is reused; the rest is measured (``zoo.explain.report``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..atomic import atomic_write_csv, atomic_write_text
from ..bench.timing import measure_inference
from ..data.run_data import data_for_run
from ..models.checkpoints import load_run
from ..models.registry import model_info
from ..runtime.console import markdown_table
from ..runtime.device import eval_device
from . import figures as viz
from .faithfulness import deletion_test
from .leaderboard import best_method, read_csv
from .report import check_data_classes, check_out_dir, evaluate, spread_test_images
from .rollout import explain


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _run_json(run_dir: Path, name: str) -> dict | None:
    """A file eval.py wrote for a run: in its eval/ folder, or (older runs) in the run directory itself."""
    return _read_json(run_dir / "eval" / name) or _read_json(run_dir / name)


def _best_faithfulness(run_dir: Path, out: Path, *labels: str) -> dict | None:
    """The best method (``leaderboard.best_method``) of a faithfulness.csv in the run's eval/ folder or the run
    directory (or else in the compare output folder) for the first of ``labels`` (the compare label, the model
    name, the run id) that it has rows for; None when there is no such file or row."""
    for path in (run_dir / "eval" / "faithfulness.csv", run_dir / "faithfulness.csv", out / "faithfulness.csv"):
        if path.is_file():
            rows = read_csv(path)
            found = next((b for b in (best_method(rows, label) for label in labels) if b is not None), None)
            if found is not None:
                return found
    return None


def compare_runs(run_dirs: Sequence[str | Path], out: str | Path, *, data_dir: str | None = None,
                 batch_size: int = 256, deletion_images: int = 64, grid_images: int = 6,
                 cache_dir: str | None = None, device: str | None = None) -> list[dict]:
    """Side by side: compare.md, compare.csv (model, whether its training finished, params, FLOPs, test top-1 and
    the number of test images it was measured on, train and inference images/s,
    deletion AUC of the model's explanation and of random, and the best method of an ``eval.py --faithfulness``
    leaderboard found in the run directory or in ``out``), accuracy_vs_throughput.png, and rollout_grid.png
    (the same test images' rollouts, or CBAM maps, across models). Reuses each run's summary.json and any
    metrics.json / benchmark.json / deletion.json found in the run directory; measures only what is missing
    (inference images/s at ``batch_size`` with few repeats; deletion on ``deletion_images`` seeded test images;
    test top-1, if neither summary.json nor metrics.json has it, on those same images only); params and FLOPs
    of a run without them in summary.json (an unfinished one) are counted on its model. A run given twice -> ValueError;
    rows are labelled by model and run id (by the run's path where two run ids are the same). ``device``: as
    ``evaluate_run``'s (None -> the GPU when there is one)."""
    out, run_dirs = Path(out), [Path(r) for r in run_dirs]
    device = eval_device(device)
    check_out_dir(out)
    resolved = [r.resolve() for r in run_dirs]
    twice = sorted({str(r) for r, p in zip(run_dirs, resolved, strict=True) if resolved.count(p) > 1})
    if twice:
        raise ValueError(f"--compare got the same run more than once: {', '.join(twice)}")
    loaded = [load_run(run_dir) for run_dir in run_dirs]
    for _, meta in loaded:  # every run's data checked before any is decoded
        check_data_classes(meta, data_dir)
    names = [r.name for r in run_dirs]
    rows, heatmaps, grid = [], {}, None
    for run_dir, (model, meta) in zip(run_dirs, loaded, strict=True):
        model.to(device)
        summary = meta["summary"]
        dm = data_for_run(meta, data_dir=data_dir, batch_size=batch_size,
                             max_test_images=max(deletion_images, grid_images), cache_dir=cache_dir)
        metrics = _run_json(run_dir, "metrics.json") or {}
        bench = _run_json(run_dir, "benchmark.json") or {}
        deletion = _run_json(run_dir, "deletion.json")
        if deletion is None:
            images, labels = spread_test_images(dm, deletion_images)
            deletion = deletion_test(model, dm.normalize(images), labels)
        shape = tuple(dm.test_dataset.images.shape[1:])
        inference = bench.get("inference_images_per_s") or measure_inference(model, shape, batch_size, repeats=3)
        top1, tested = summary.get("test_top1"), (meta.get("config") or {}).get("max_test_images")
        if top1 is None and metrics.get("test_top1") is not None:
            top1, tested = metrics["test_top1"], metrics.get("num_images")
        if top1 is None:
            found = evaluate(model, dm)[0]
            top1, tested = found["test_top1"], found["num_images"]
        info = model_info(model) if summary.get("params") is None or summary.get("flops") is None else summary
        run_id = run_dir.name if names.count(run_dir.name) == 1 else str(run_dir)
        label = f"{meta['model_name']} ({run_id})" if len(run_dirs) > 1 else meta["model_name"]
        best = _best_faithfulness(run_dir, out, label, meta["model_name"], run_dir.name)
        explained = deletion["explanation"]
        rows.append({
            "model": label, "training": training_status(meta), "params": info["params"], "flops": info["flops"],
            "test_top1": top1, "test_images": tested,
            "train_images_per_s": summary.get("train_images_per_s"), "inference_images_per_s": inference,
            "deletion_explanation": explained,
            "deletion_auc": deletion["auc"].get(explained) if explained else None,
            "deletion_auc_random": deletion["auc"]["random"],
            "faithfulness_best": None if best is None else (
                f"{best['method']} (deletion AUC {best['auc']:.3f}, {best['removal']} removal, p vs random "
                f"{best['p_vs_random']:.2g}, {best['num_images']} images)"),
        })
        if grid is None:
            grid = (*spread_test_images(dm, grid_images), dm)
        heatmap = explain(model, grid[2].normalize(grid[0]).to(device)).heatmap  # None: a model without attention
        heatmaps[label] = None if heatmap is None else heatmap.cpu()
        model.cpu()  # the device holds one compared model at a time
    _write_table(rows, out, batch_size)
    viz.save(viz.accuracy_throughput_figure([r["model"] for r in rows], [r["test_top1"] for r in rows],
                                            [r["inference_images_per_s"] for r in rows]),
             out / "accuracy_vs_throughput.png")
    images, labels, dm = grid
    viz.save(viz.rollout_grid_figure(images.float() / 255, heatmaps,
                                     captions=[dm.class_names[i] for i in labels]), out / "rollout_grid.png")
    return rows


def training_status(meta: dict) -> str:
    """"finished" for a run whose summary.json holds its test (train.py writes it at the end), else "unfinished"
    with how far its checkpoint got (Lightning's 0-based epoch counted from 1) against the recipe's epochs."""
    if (meta.get("summary") or {}).get("test_top1") is not None:
        return "finished"
    epoch, step, epochs = meta.get("epoch"), meta.get("global_step"), (meta.get("config") or {}).get("epochs")
    where = [f"epoch {epoch + 1}" + (f" of {epochs}" if epochs else "") if epoch is not None else None,
             None if step is None else f"step {step:,}"]
    return "unfinished" + (f" (checkpoint at {', '.join(w for w in where if w)})" if any(where) else "")


def _write_table(rows: list[dict], out: Path, batch_size: int) -> None:
    columns = list(rows[0])
    atomic_write_csv(out / "compare.csv", columns, rows)

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else f"{value:,}" if isinstance(value, int) else str(value)

    def shown(row: dict, column: str) -> str:
        if column == "test_images" and row[column] is None:
            return "whole test split"
        return cell(row[column])

    lines = markdown_table(columns, [[shown(r, c) for c in columns] for r in rows])
    note = ("\nAccuracies are fractions of the test_images test images (the seeded subset a run was tested on, or "
            "that this comparison tested where the run has no test result; an unfinished run has none: its "
            "training did not reach the recipe's end). inference_images_per_s: no-grad forwards of "
            f"{batch_size} random images (--batch-size), or the run's benchmark.json where it has one. "
            "Deletion AUC: area under top-1 vs fraction of 8x8 patches blanked, most important first (lower = "
            "more faithful explanation). faithfulness_best: the best method of the faithfulness.csv "
            "(eval.py --faithfulness) in the run directory or this folder.\n")
    atomic_write_text(out / "compare.md", "\n".join(lines) + "\n" + note)
