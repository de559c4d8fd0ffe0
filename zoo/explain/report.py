"""Evaluating trained runs, what ``eval.py`` calls: test metrics with a confusion matrix and the most confused
class pairs, attention / CBAM figures for a few test images, the deletion test (zoo.explain), speed
(zoo.bench); the side-by-side comparison of several runs is ``zoo.explain.compare``. Every function writes into an
output folder and returns what it wrote, so a notebook can do what the command line does. Under torchrun / SLURM,
``evaluate_run`` splits the test set among the processes (contiguous, unpadded shards: each image counted once) and
rank 0 writes.
"""

from __future__ import annotations

import html
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassConfusionMatrix

from ..atomic import atomic_write_json, atomic_write_text
from ..bench.timing import benchmark_model
from ..data import DataError, ImageData, data_class_names
from ..data.run_data import data_for_run
from ..models.checkpoints import load_run, load_shipped
from ..runtime.device import eval_device
from ..runtime.distributed import is_global_zero, open_process_group, rank_zero_first
from . import figures as viz
from .faithfulness import deletion_test
from .progress import counted
from .rollout import explain


def check_data_classes(meta: dict, data_dir: str | None = None) -> None:
    """The data a run is evaluated on must have the run's classes (its summary.json / model card
    ``class_names``, in order, else its number of classes); read from the folder names or CIFAR-10's meta file,
    before anything is decoded. A mismatch -> ValueError naming both."""
    cfg = meta.get("config") or {}
    root = Path(data_dir if data_dir is not None else cfg.get("data_dir") or "data")
    found = data_class_names(root)
    recorded = (meta.get("summary") or {}).get("class_names")
    if recorded is not None and list(recorded) != found:
        raise DataError(f"the data in {root} has the classes {found}, the run was trained on {list(recorded)}")
    if recorded is None and meta.get("num_classes") not in (None, len(found)):
        raise DataError(f"the data in {root} has {len(found)} classes, the run was trained on "
                        f"{meta['num_classes']}")


def check_out_is_folder(out: str | Path) -> None:
    """``out`` must be a folder or not exist yet: a file there or above it -> ValueError naming it."""
    out = Path(out).resolve()
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is a file; name a folder (it is created if needed)")


def check_out_dir(out: str | Path) -> None:
    """``out`` must be a folder or not exist yet (``check_out_is_folder``), and must not lie inside a run directory
    (config.yaml beside checkpoints/), except in that run's own ``eval/`` folder: evaluation files would mix with the
    run's files (metrics.csv, checkpoints) or replace them (ValueError naming both folders)."""
    check_out_is_folder(out)
    out = Path(out).resolve()
    for folder in (out, *out.parents):
        if (folder / "config.yaml").is_file() and (folder / "checkpoints").is_dir():
            own = folder / "eval"
            if out != own and own not in out.parents:
                raise ValueError(f"--out {out} lies inside the run directory {folder}: write elsewhere, or into "
                                 f"the run's own eval folder {own}")
            return


def progress(line: str) -> None:
    """A stage of the work on stderr (standard output holds the results), so a long evaluation is not silent;
    rank 0's only under several processes."""
    if is_global_zero():
        print(line, file=sys.stderr, flush=True)


def most_confused(matrix: torch.Tensor, class_names: Sequence[str], top: int = 5) -> list[dict]:
    """The ``top`` largest off-diagonal cells of a (C, C) confusion matrix (rows true, columns predicted):
    [{"true", "predicted", "count", "fraction" (of the true class's images)}], largest first, no zeros."""
    off = matrix.clone().float()
    off.fill_diagonal_(-1)
    counts, flat = off.flatten().topk(min(top, off.numel()))
    rows = matrix.sum(dim=1)
    pairs = []
    for count, index in zip(counts.tolist(), flat.tolist(), strict=True):
        if count <= 0:
            break
        i, j = divmod(index, matrix.shape[1])
        pairs.append({"true": class_names[i], "predicted": class_names[j], "count": int(count),
                      "fraction": count / rows[i].item()})
    return pairs


@torch.no_grad()
def evaluate(model: nn.Module, dm: ImageData, *, progress_on: bool = True) -> tuple[dict, torch.Tensor]:
    """Test-set metrics of ``model`` on ``dm`` (set up for "test"): ({"test_top1", "test_top5",
    "test_cross_entropy" (plain: no label smoothing, no test-time augmentation), "per_class_accuracy":
    {name: fraction, None for a class none of the tested images holds}, "most_confused": [...], "num_images"},
    confusion matrix (C, C)). With a process group open, each rank evaluates its share of the test set
    (``dm.test_dataloader``) and every rank returns the metrics of the whole set."""
    device = next(model.parameters()).device
    model.eval()
    c = dm.num_classes
    # labels checked by the data module: torchmetrics' own check reads the batch on the host (torch.unique)
    confusion = MulticlassConfusionMatrix(num_classes=c, validate_args=False).to(device)
    # the sums stay on the device until the end (one host read, not three per batch); float64 keeps counts exact
    totals = torch.zeros(3, dtype=torch.float32 if device.type == "mps" else torch.float64, device=device)
    count = 0
    loader = dm.test_dataloader()  # this rank's share: a count of it on rank 0 (zoo.explain.progress)
    shard = len(loader.sampler)
    for images, labels in counted(loader, total=shard, desc=f"testing ({shard:,} images)", unit="images",
                                  size=lambda batch: len(batch[1]), enabled=is_global_zero() and progress_on):
        images, labels = dm.normalize(images.to(device)), labels.to(device)
        logits = model(images).float()
        best = logits.topk(min(5, c), dim=1).indices
        totals += torch.stack([(best[:, 0] == labels).sum(), (best == labels[:, None]).any(dim=1).sum(),
                               F.cross_entropy(logits, labels, reduction="sum")]).to(totals.dtype)
        confusion.update(best[:, 0], labels)
        count += len(labels)
    matrix = confusion.compute().cpu()  # torchmetrics sums the ranks' matrices when a process group is open
    top1, top5, loss, count = _sum_over_ranks([*totals.tolist(), count], device)
    count = int(count)
    per_class = [None if n == 0 else right / n  # None: the tested images hold none of that class
                 for right, n in zip(matrix.diag().tolist(), matrix.sum(dim=1).tolist(), strict=True)]
    metrics = {
        "num_images": count, "test_top1": top1 / count, "test_top5": top5 / count,
        "test_cross_entropy": loss / count,
        "per_class_accuracy": dict(zip(dm.class_names, per_class, strict=True)),
        "most_confused": most_confused(matrix, dm.class_names),
    }
    return metrics, matrix


def _sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """``values`` summed over the ranks of the open process group (unchanged without one); float64, so counts
    stay exact."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    sums = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    torch.distributed.all_reduce(sums)
    return [float(v) for v in sums.tolist()]


def spread_test_images(dm: ImageData, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` uint8 test images and labels evenly spaced through the test set, which is stored sorted by
    class, so a few images cover every class instead of the first one."""
    n = len(dm.test_dataset.labels)
    index = torch.linspace(0, n - 1, min(count, n)).round().long()
    return dm.test_dataset.images[index], dm.test_dataset.labels[index]


def explain_images(model: nn.Module, dm: ImageData, num_images: int, out: Path) -> list[Path]:
    """For ``num_images`` test images spread over the classes: the attention maps of every layer over the
    final token set (maps_<i>.npy, (L, H, N, N), as the rollout uses them) and their PNG grid, CBAM gates
    (cbam_<i>_stage<k>.npy), and one figure per image (image | rollout overlay | CBAM stage maps) titled with
    the true and predicted class; index.html shows every image's figure and links its other files. Returns the
    files written."""
    out.mkdir(parents=True, exist_ok=True)
    images, labels = spread_test_images(dm, num_images)
    device = next(model.parameters()).device
    normalised = dm.normalize(images.to(device))
    found = explain(model, normalised)
    shown = dm.denormalize(normalised).cpu()
    predicted = found.logits.argmax(dim=1)
    written = []
    for i in range(len(images)):
        tag = f"{i:03d}"
        maps = [m[i] for m in found.recording.maps if m.shape[-2:] == found.recording.maps[-1].shape[-2:]]
        if maps:
            np.save(out / f"maps_{tag}.npy", torch.stack(maps).numpy())
            title = f"test image {i}: {dm.class_names[labels[i]]} (attention weights per layer and head)"
            written += [out / f"maps_{tag}.npy", viz.save(viz.attention_grid_figure(maps, title=title),
                                                             out / f"maps_{tag}.png")]
        gates = [g[i, 0] for g in found.recording.cbam]
        for k, gate in enumerate(gates, start=1):
            np.save(out / f"cbam_{tag}_stage{k}.npy", gate.numpy())
            written.append(out / f"cbam_{tag}_stage{k}.npy")
        fig = viz.explanation_figure(shown[i], true_name=dm.class_names[labels[i]],
                                     pred_name=dm.class_names[predicted[i]],
                                     rollout=None if found.rollout is None else found.rollout[i], cbam=gates)
        written.append(viz.save(fig, out / f"explain_{tag}.png"))
    written.append(attention_index(out, written, [(dm.class_names[labels[i]], dm.class_names[predicted[i]])
                                                  for i in range(len(images))]))
    return written


def attention_index(out: Path, files: Sequence[Path], names: Sequence[tuple[str, str]]) -> Path:
    """out/index.html: per explained image (``names``: its true and predicted class) its explain_<i>.png
    shown and its other ``files`` (attention grid, .npy arrays) linked, by relative paths."""
    sections = []
    for i, (true, predicted) in enumerate(names):
        tag = f"{i:03d}"
        mine = [f.name for f in files if f.stem.split("_")[1:2] == [tag] and f.name != f"explain_{tag}.png"]
        links = " ".join(f'<a href="{html.escape(name)}">{html.escape(name)}</a>' for name in mine)
        sections.append(f"<h2>test image {i}: {html.escape(true)} (predicted {html.escape(predicted)})</h2>"
                        f'<img src="explain_{tag}.png" alt="test image {i} explained"><p>{links}</p>')
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>attention</title>"
            "<style>body{font-family:sans-serif;margin:1.5em}img{max-width:100%}</style></head><body>"
            "<h1>Attention, rollout and CBAM gates of the explained test images</h1>"
            "<p>Each figure: the image, its attention rollout and each CBAM stage's spatial gate (the gate "
            "multiplies that stage's features: lower = suppressed); below it the attention weights per layer "
            "and head (maps_*.png), the arrays they are drawn from (*.npy).</p>"
            + "".join(sections) + "</body></html>\n")
    atomic_write_text(out / "index.html", page)
    return out / "index.html"


def run_deletion(model: nn.Module, dm: ImageData, num_images: int, out: Path, *, title: str) -> dict:
    """Deletion test on ``num_images`` test images spread over the classes; writes deletion.json and
    deletion.png."""
    images, labels = spread_test_images(dm, num_images)
    result = deletion_test(model, dm.normalize(images), labels)
    atomic_write_json(out / "deletion.json", result)
    viz.save(viz.deletion_figure(result, title=title), out / "deletion.png")
    return result


def evaluate_run(checkpoint: str | Path | None, out: str | Path, *, pretrained: str | None = None,
                 data_dir: str | None = None,
                 batch_size: int = 256, max_test_images: int | None = None, attention_images: int = 0,
                 deletion_images: int = 0, benchmark: bool = False, precision: str = "32",
                 device: str | None = None, cache_dir: str | None = None) -> dict:
    """Everything ``eval.py --checkpoint`` (or ``--pretrained NAME``: a shipped model, no run) does. Writes
    into ``out``: metrics.json and confusion_matrix.png; with ``attention_images`` an attention/ folder; with
    ``deletion_images`` deletion.json/.png; with ``benchmark`` benchmark.json. Returns {"metrics",
    "deletion", "benchmark"} (None where not asked). ``device``: None -> the GPU when there is one. Every check
    (device, checkpoint, the data's classes against the run's) comes before anything is decoded or written.
    Under torchrun / SLURM the metrics are computed over all processes (the GPU of each one's local rank) and
    rank 0 alone writes and runs the rest; the other ranks return the metrics."""
    out = Path(out)
    device = eval_device(device)
    open_process_group("gpu" if device.type == "cuda" else "cpu")
    model, meta = load_shipped(pretrained) if pretrained else load_run(checkpoint)
    check_data_classes(meta, data_dir)
    check_out_dir(out)
    model.to(device)
    name = meta["model_name"]
    dm = rank_zero_first(lambda: data_for_run(meta, data_dir=data_dir, batch_size=batch_size,
                                                 max_test_images=max_test_images, cache_dir=cache_dir))
    if pretrained:  # normalised as the weights were trained, whatever the statistics of this copy of the data
        dm.use_normalization(model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
    # after the data module's checks, so a refused argument is the only line on stderr
    progress(f"{name}: testing on {len(dm.test_dataset.labels):,} images on {device}")
    metrics, matrix = evaluate(model, dm)
    metrics = {"model": name, "checkpoint": meta["ckpt_path"], **metrics}
    if not is_global_zero():
        return {"metrics": metrics, "deletion": None, "benchmark": None}
    atomic_write_json(out / "metrics.json", metrics)
    viz.save(viz.confusion_matrix_figure(matrix, dm.class_names, title=f"{name}: test confusion matrix "
                                         f"(top-1 {metrics['test_top1']:.3f})"), out / "confusion_matrix.png")
    report = {"metrics": metrics, "deletion": None, "benchmark": None}
    if attention_images:
        progress(f"{name}: attention maps, rollouts and figures of {attention_images} test images")
        explain_images(model, dm, attention_images, out / "attention")
    if deletion_images:
        progress(f"{name}: deletion test on {deletion_images} test images")
        report["deletion"] = run_deletion(model, dm, deletion_images, out, title=f"{name} deletion test")
    if benchmark:
        progress(f"{name}: measuring speed")
        shape = tuple(dm.test_dataset.images.shape[1:])
        report["benchmark"] = benchmark_model(model, shape, num_classes=dm.num_classes, precision=precision)
        atomic_write_json(out / "benchmark.json", {"model": name, **report["benchmark"]})
    return report
