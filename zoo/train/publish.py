"""Sharing a trained run's weights: ``publish_run`` evaluates a run's model on the whole test set (without and
with test-time augmentation) and writes a folder in the Hugging Face Hub's layout (``zoo.models.hub``):
config.json with the pretrained cfg and the model card (recipe, command, machine, wall time, accuracies, params,
FLOPs, the training data's mean / std), model.safetensors and a README.md model card, each atomically; a folder that
already holds any of them is refused unless ``force`` (``--force``).
``timm.create_model("local-dir:" + folder, pretrained=True)`` loads it (after ``import zoo``), and so does
``hf-hub:USER/REPO`` once the folder is uploaded (``huggingface_hub.upload_folder``). Maintainers ship weights with
``--ship``: the folder goes to ``zoo/weights/<model>/``, which ``zoo.create_model(name, pretrained=True)`` reads.

    python -m zoo.train.publish RUN_DIR --out DIR --command "python train.py ..."
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from datetime import date
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_write, atomic_write_json, atomic_write_text
from ..data import ImageData
from ..data.run_data import data_for_run
from ..models.checkpoints import load_run
from ..models.hub import HUB_README, hub_config, hub_readme
from ..models.registry import HUB_CONFIG, HUB_WEIGHTS, WEIGHTS_DIR, model_info
from ..models.tta import REPORTED_TTA, tta_logits

EVAL_BATCH = 500
CHECK_IMAGES = 1000  # the card also gives the accuracy on this many test images, for a quick check of a copy


def spread_indices(n: int, count: int) -> torch.Tensor:
    """``count`` indices evenly spaced through ``range(n)`` (a test set sorted by class: every class covered)."""
    return torch.linspace(0, n - 1, min(count, n)).round().long()


@torch.no_grad()
def test_accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean, std, tta: int = 0) -> float:
    """Top-1 of ``model`` on uint8 (N, 3, H, W) ``images`` normalised with ``mean`` / ``std`` (3 floats in
    [0, 1] units), under test-time augmentation level ``tta`` (0: none)."""
    model.eval()
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in (mean, std))
    correct = 0
    for start in range(0, len(labels), EVAL_BATCH):
        x = (images[start:start + EVAL_BATCH].float() / 255 - mean) / std
        correct += (tta_logits(model, x, tta).argmax(1) == labels[start:start + EVAL_BATCH]).sum().item()
    return correct / len(labels)


def build_card(model: nn.Module, meta: dict, dm: ImageData, command: str) -> dict:
    """The model card of a run's model: what it is, how it was trained, how well it does on ``dm``'s test set."""
    summary, config = meta["summary"], meta["config"]
    if list(summary.get("class_names", dm.class_names)) != list(dm.class_names):
        raise ValueError(f"the run was trained on classes {summary.get('class_names')}, the test data has "
                         f"{dm.class_names}; pass the --data-dir it was trained on")
    images, labels = dm.test_dataset.images, dm.test_dataset.labels
    mean, std = summary.get("mean", dm.mean), summary.get("std", dm.std)
    info = model_info(model)
    check = spread_indices(len(labels), CHECK_IMAGES)
    return {
        "model": meta["model_name"], "model_args": meta["model_args"], "num_classes": meta["num_classes"],
        "class_names": list(dm.class_names), "img_size": summary.get("img_size", dm.img_size),
        "mean": list(mean), "std": list(std), "params": info["params"], "flops": info["flops"],
        "test_images": len(labels),
        "test_top1": test_accuracy(model, images, labels, mean, std, tta=0),
        "test_top1_tta": test_accuracy(model, images, labels, mean, std, tta=REPORTED_TTA), "tta_level": REPORTED_TTA,
        "check_images": len(check), "check_top1": test_accuracy(model, images[check], labels[check], mean, std),
        "command": command, "recipe": config, "machine": summary.get("machine", "unknown"),
        "precision": summary.get("precision"), "wall_time_s": summary.get("wall_time_s"),
        "global_step": meta["global_step"], "epochs": summary.get("epochs"),
        "train_images_per_s": summary.get("train_images_per_s"), "published": date.today().isoformat(),
        "torch": torch.__version__,
    }


def check_out_dir(out_dir: str | Path, force: bool = False) -> None:
    """``out_dir`` holding a published model's files (config.json, model.safetensors, README.md) -> ValueError
    naming them and ``--force``, unless ``force``."""
    held = [name for name in (HUB_CONFIG, HUB_WEIGHTS, HUB_README) if (Path(out_dir) / name).exists()]
    if held and not force:
        raise ValueError(f"{out_dir} already holds {', '.join(held)}: pass --force to replace them, or another "
                         "--out")


def write_hub_folder(out_dir: str | Path, weights: bytes, card: dict) -> Path:
    """Write ``out_dir/{config.json, model.safetensors, README.md}`` (each file atomically) and return out_dir;
    ``weights`` is the safetensors file's content."""
    out_dir = Path(out_dir)
    atomic_write(out_dir / HUB_WEIGHTS, lambda f: f.write(weights))
    atomic_write_json(out_dir / HUB_CONFIG, hub_config(card))
    atomic_write_text(out_dir / HUB_README, hub_readme(card))
    return out_dir


def publish_run(run_dir: str | Path, out_dir: str | Path, *, data_dir: str | Path | None = None,
                command: str | None = None, cache_dir: str | Path | None = None,
                max_test_images: int | None = None, force: bool = False) -> dict:
    """Write ``out_dir/{config.json, model.safetensors, README.md}`` for the run in ``run_dir`` (its best
    checkpoint), evaluated on the test split of ``data_dir`` (default: the run's; ``max_test_images``: a
    seeded subset, for tests); ``command``: how it was trained (default: the run's ``train.py --config``
    with its config.yaml). An ``out_dir`` that already holds any of those files -> ValueError before anything is
    read, unless ``force``. Returns the model card."""
    from safetensors.torch import save

    check_out_dir(out_dir, force)
    model, meta = load_run(run_dir)
    data_dir = data_dir or meta["config"].get("data_dir")
    if data_dir is None:
        raise ValueError(f"{run_dir} records no data folder: pass data_dir")
    command = command or f"python train.py --config {Path(meta['ckpt_path']).parents[1] / 'config.yaml'}"
    dm = data_for_run(meta, data_dir=data_dir, cache_dir=cache_dir, max_test_images=max_test_images)
    card = build_card(model, meta, dm, command)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    blob = save(state, metadata={"model": card["model"], "format": "pt"})
    card["sha256"] = hashlib.sha256(blob).hexdigest()
    write_hub_folder(out_dir, blob, card)
    return card


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write a trained run's weights and model card in the Hugging Face "
                                "Hub's layout, which timm.create_model('local-dir:DIR', pretrained=True) loads.")
    p.add_argument("run_dir", help="a run directory written by train.py")
    p.add_argument("--data-dir", help="the data whose test split is evaluated (default: the run's)")
    p.add_argument("--command", help="the command that trained the run, for the model card (default: train.py "
                   "with the run's config.yaml)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", help="output folder (default: published/<model> in the current folder)")
    where.add_argument("--ship", action="store_true",
                       help="maintainers: write into the package, zoo/weights/<model>/, the weights the zoo ships")
    p.add_argument("--force", action="store_true", help="replace the config.json, model.safetensors and README.md "
                   "that --out already holds (refused without it); --ship always replaces the shipped weights")
    args = p.parse_args(argv)
    try:
        if args.out:  # refused before the run is read
            check_out_dir(args.out, args.force)
        model = load_run(args.run_dir)[1]["model_name"]  # the folder's name comes before the test set is read
        out = WEIGHTS_DIR / model if args.ship else Path(args.out or Path("published") / model)
        card = publish_run(args.run_dir, out, data_dir=args.data_dir, command=args.command,
                           force=args.force or args.ship)
    except (ValueError, OSError) as err:
        print(f"publish: error: {err}", file=sys.stderr)
        return 2
    print(f"{card['model']}: test top-1 {card['test_top1']:.4f} ({card['test_top1_tta']:.4f} with TTA) on "
          f"{card['test_images']} images -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
