"""Where the data is and how it is laid out: ``find_layout`` tells an ImageFolder tree (``DIR/train/<class>/``
and ``DIR/test/<class>/``) from torchvision's CIFAR-10 python batches (``DIR/cifar-10-batches-py``, or that
folder itself; https://www.cs.toronto.edu/~kriz/cifar.html), downloads CIFAR-10 only when asked, and
``list_imagefolder`` lists a tree's class names and files. Anything else is a ``DataError`` (a ``ValueError``)
whose one-line message names the folder, what it found and the layouts it expected."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torchvision

CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = ["test_batch"]
CIFAR_META = "batches.meta"
SPLITS = ("train", "test")


class DataError(ValueError):
    """The data cannot be found or read: a missing / empty / wrongly laid out folder, or no data offline."""


def layout_error(root: Path, problem: str) -> DataError:
    """A DataError saying ``problem`` and which layouts of ``root`` would have been read."""
    return DataError(
        f"{problem}; expected {root}/train/<class>/<images> and {root}/test/<class>/<images> (ImageFolder) "
        f"or {root}/{CIFAR_DIR} (CIFAR-10 python batches): fetch CIFAR-10 there with train.py --download "
        f"(download=True), or copy CIFAR-10 into {root}/{CIFAR_DIR}"
    )


def find_layout(root: Path, download: bool) -> tuple[str, Path]:
    """("imagefolder", root) or ("cifar", the cifar-10-batches-py folder); downloads only if asked."""
    if (root / "train").is_dir() and (root / "test").is_dir():
        return "imagefolder", root
    if (root / CIFAR_DIR).is_dir():
        return "cifar", root / CIFAR_DIR
    if root.name == CIFAR_DIR and (root / CIFAR_TRAIN[0]).is_file():
        return "cifar", root
    if download:
        download_cifar10(root)
        return "cifar", root / CIFAR_DIR
    if not root.exists():
        raise layout_error(root, f"data folder {root} does not exist")
    entries = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    if not entries:
        raise layout_error(root, f"data folder {root} is empty")
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    raise layout_error(root, f"data folder {root} holds no dataset (found {shown})")


def download_cifar10(root: Path) -> None:
    """torchvision's CIFAR-10 archive, checked against its md5 and extracted into ``root/cifar-10-batches-py``."""
    try:
        cifar = torchvision.datasets.CIFAR10
        torchvision.datasets.utils.download_and_extract_archive(cifar.url, str(root), filename=cifar.filename,
                                                                md5=cifar.tgz_md5)
    except (OSError, RuntimeError) as err:  # URLError is an OSError
        reason = " ".join(str(err).split())
        raise DataError(
            f"could not download CIFAR-10 into {root} ({type(err).__name__}: {reason}); copy CIFAR-10 into "
            f"{root}/{CIFAR_DIR}, or pass --data-dir DIR, a folder holding train/<class>/ and test/<class>/ "
            f"images or {CIFAR_DIR}"
        ) from err


def class_folders(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]


def _files(folder: Path) -> list[str]:
    """The sorted names of the visible files in ``folder`` ([] if it does not exist)."""
    if not folder.is_dir():
        return []
    return sorted(e.name for e in os.scandir(folder) if e.is_file() and not e.name.startswith("."))


def warn_odd_classes(root: Path, class_names: list[str]) -> None:
    """A warning (one line) for each class folder that is a link to a folder outside ``root``, and each train/
    class folder that holds no image file: both still count (the model gets an output for such a class), which
    is rarely meant."""
    inside = root.resolve()
    for split in SPLITS:
        for name in class_names:
            folder = root / split / name
            if folder.is_dir() and not folder.resolve().is_relative_to(inside):
                warnings.warn(f"class folder {folder} links outside the data folder (to {folder.resolve()}); its "
                              "images are read as class " + repr(name), stacklevel=3)
            if split == "train" and not _files(folder):
                warnings.warn(f"class folder {folder} holds no files but still counts as a class (the model gets "
                              "an output for it): remove the folder if it is not one", stacklevel=3)


def list_imagefolder(root: Path) -> tuple[list[str], dict[str, tuple[list[str], list[int]]]]:
    """Class names (the sorted folders of train/) and, per split, the sorted file paths (as strings) with their
    labels."""
    class_names = sorted(class_folders(root / "train"))
    if not class_names:
        raise layout_error(root, f"{root}/train has no class folders")
    warn_odd_classes(root, class_names)
    files: dict[str, tuple[list[Path], list[int]]] = {}
    for split in SPLITS:
        unknown = sorted(set(class_folders(root / split)) - set(class_names))
        if unknown:
            raise layout_error(root, f"{root}/{split} has classes {unknown} that {root}/train lacks")
        paths, labels = [], []
        for label, name in enumerate(class_names):
            names = _files(root / split / name)
            folder = f"{root / split / name}{os.sep}"
            paths += [folder + n for n in names]  # strings: 60,000 Path objects cost a second on a slow CPU
            labels += [label] * len(names)
        if not paths:
            raise layout_error(root, f"{root}/{split} holds no image files")
        files[split] = (paths, labels)
    return class_names, files
