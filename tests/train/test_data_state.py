"""State of an image folder the data module can trust: contents replaced under the same file names rebuild the
decoded cache (the reference: the images decoded by PIL from the files as they are now), and an empty class
folder or one linked from outside the data folder is named in a warning."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from zoo.data import ImageData

CLASSES = ["cat", "dog"]


def write_tree(root: Path, per_class: int = 3, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for split in ("train", "test"):
        for name in CLASSES:
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                    root / split / name / f"{i}.png")


def pil_images(folder: Path) -> torch.Tensor:
    """The train images of ``folder`` as PIL decodes them (N, 3, 32, 32), in class then file-name order."""
    files = [folder / "train" / c / f for c in CLASSES for f in sorted(os.listdir(folder / "train" / c))]
    return torch.stack([torch.from_numpy(np.asarray(Image.open(f).convert("RGB"))).permute(2, 0, 1) for f in files])


def decoded(data: Path, cache: Path) -> ImageData:
    dm = ImageData(data, cache_dir=cache, val_size=1, batch_size=2)
    dm.setup("fit")
    return dm


def sorted_like_files(dm: ImageData) -> torch.Tensor:
    """All train images of the module back in file order (the validation split is a seeded subset)."""
    n = len(dm.train_dataset.labels) + len(dm.val_dataset.labels)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(dm.seed))
    val_idx, train_idx = order[: dm.val_size].sort().values, order[dm.val_size:].sort().values
    images = torch.empty(n, *dm.train_dataset.images.shape[1:], dtype=torch.uint8)
    images[train_idx], images[val_idx] = dm.train_dataset.images, dm.val_dataset.images
    return images


@pytest.mark.parametrize("how", ["rewrite", "rename"])
def test_contents_swapped_under_the_same_names_rebuild_the_cache(tmp_path, how):
    data, cache = tmp_path / "data", tmp_path / "cache"
    write_tree(data)
    dm = decoded(data, cache)
    before = sorted_like_files(dm)
    torch.testing.assert_close(before, pil_images(data), rtol=0, atol=0)
    a, b = data / "train" / "cat" / "0.png", data / "train" / "dog" / "0.png"
    if how == "rewrite":  # a data set exported again under the same names
        a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
        a.write_bytes(b_bytes)
        b.write_bytes(a_bytes)
    else:  # files moved between classes: names, sizes and modification times all travel with them
        os.replace(a, tmp_path / "swap.png")
        os.replace(b, a)
        os.replace(tmp_path / "swap.png", b)
    with pytest.warns(UserWarning, match="data files changed"):
        dm = decoded(data, cache)
    after = sorted_like_files(dm)
    torch.testing.assert_close(after, pil_images(data), rtol=0, atol=0)
    assert not torch.equal(after, before)


def test_empty_class_folder_is_named_in_a_warning(tmp_path):
    data = tmp_path / "data"
    write_tree(data)
    (data / "train" / "zebra").mkdir()
    with pytest.warns(UserWarning, match=r"zebra holds no files but still counts as a class"):
        dm = decoded(data, tmp_path / "cache")
    assert dm.class_names == ["cat", "dog", "zebra"]


def test_class_folder_linked_from_outside_is_named_in_a_warning(tmp_path):
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    write_tree(data)
    write_tree(elsewhere)
    (data / "train" / "fox").symlink_to(elsewhere / "train" / "cat", target_is_directory=True)
    with pytest.warns(UserWarning, match=r"fox links outside the data folder"):
        decoded(data, tmp_path / "cache")


def test_a_clean_tree_warns_about_nothing(tmp_path):
    data = tmp_path / "data"
    write_tree(data)
    (data / "train" / "inner").symlink_to(data / "train" / "cat", target_is_directory=True)  # inside: fine
    (data / "test" / "inner").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        decoded(data, tmp_path / "cache")
