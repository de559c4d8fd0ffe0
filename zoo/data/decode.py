"""Turning data files into tensors: ImageFolder images (any size: the shorter side resized, antialiased, then
centre-cropped to ``img_size``) and torchvision's CIFAR-10 python batches (read by ``cifar``, which runs no code)
become uint8 (N, 3, H, W) images with int64 (N,) labels, per split. Seeded random subsets pick the images first,
so only the chosen files are decoded; a file that does not decode is skipped with a warning naming it (one bad
file in 50,000 does not stop a run). ``data_class_names`` reads the classes without decoding an image."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as TF

from .cifar import read_cifar_batches, read_label_names
from .layout import SPLITS, class_folders, find_layout, layout_error, list_imagefolder

Limits = dict[str, int | None]  # split -> most images to keep (None: all; 0: the split is not decoded)


def subset(n: int, limit: int | None, seed: int) -> torch.Tensor:
    """Sorted indices of a seeded random subset of ``min(n, limit)`` of ``range(n)`` (all if None)."""
    if limit is None or limit >= n:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:limit].sort().values


def fit_size(image: torch.Tensor, img_size: int) -> torch.Tensor:
    """(3, h, w) uint8 -> (3, img_size, img_size): shorter side resized (antialiased), centre crop."""
    if image.shape[-2:] == (img_size, img_size):
        return image
    image = TF.resize(image, img_size, antialias=True)
    return TF.center_crop(image, [img_size, img_size])


def decode_files(paths: list[str | Path], img_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode image files into (N_ok, 3, img_size, img_size) uint8 and the bool mask of files kept.

    A file that does not decode is skipped with a warning naming it."""
    images = torch.empty(len(paths), 3, img_size, img_size, dtype=torch.uint8)
    kept = torch.ones(len(paths), dtype=torch.bool)
    for i, path in enumerate(paths):
        try:
            images[i] = fit_size(decode_image(str(path), mode=ImageReadMode.RGB), img_size)
        except (RuntimeError, OSError, ValueError) as err:
            reason = " ".join(str(err).split())
            warnings.warn(f"skipping {path}: not a readable image ({reason})", stacklevel=2)
            kept[i] = False
    return images[kept], kept


def decode_imagefolder(source: Path, img_size: int, limits: Limits, seed: int) -> dict:
    """An ImageFolder tree as {"class_names", "<split>_images", "<split>_labels"}; split i is subset with
    ``seed + i``."""
    class_names, files = list_imagefolder(source)
    decoded: dict = {"class_names": class_names}
    for offset, split in enumerate(SPLITS):
        paths, labels = files[split]
        chosen = subset(len(paths), limits[split], seed + offset).tolist()
        images, kept = decode_files([paths[i] for i in chosen], img_size)
        if len(images) == 0 and limits[split] != 0:
            raise layout_error(source, f"no readable images in {source}/{split}")
        decoded[f"{split}_images"] = images
        decoded[f"{split}_labels"] = torch.tensor([labels[i] for i in chosen], dtype=torch.int64)[kept]
    return decoded


def decode_cifar(source: Path, img_size: int, limits: Limits, seed: int) -> dict:
    """CIFAR-10 python batches as {"class_names", "<split>_images", "<split>_labels"}, resized when
    ``img_size`` is not 32; split i is subset with ``seed + i``."""
    class_names, splits = read_cifar_batches(source)
    decoded: dict = {"class_names": class_names}
    for offset, (split, (images, labels)) in enumerate(splits.items()):
        chosen = subset(len(labels), limits[split], seed + offset)
        images, labels = torch.from_numpy(images)[chosen], torch.from_numpy(labels)[chosen]
        if images.shape[-1] != img_size:
            images = TF.resize(images, [img_size, img_size], antialias=True)
        decoded[f"{split}_images"], decoded[f"{split}_labels"] = images.contiguous(), labels
    return decoded


def decode_splits(layout: str, source: Path, img_size: int, limits: Limits, seed: int) -> dict:
    """The data of a layout found by ``find_layout`` as {"class_names", "train_images", "train_labels",
    "test_images", "test_labels"}."""
    decode = decode_imagefolder if layout == "imagefolder" else decode_cifar
    return decode(source, img_size, limits, seed)


def data_class_names(root: Path) -> list[str]:
    """The class names of the data in ``root`` without decoding an image: an ImageFolder tree's sorted train/
    folders, or CIFAR-10's ``batches.meta`` (read by ``cifar``, which runs no code); no dataset there or a
    damaged meta file -> DataError (never downloads)."""
    layout, source = find_layout(root, download=False)
    if layout == "imagefolder":
        return sorted(class_folders(source / "train"))
    return read_label_names(source)
