"""The data pipeline: CIFAR-10 (https://www.cs.toronto.edu/~kriz/cifar.html) or any ImageFolder tree, decoded
once into a uint8 tensor cache, held in memory (on the GPU when the trainer trains on one) and augmented in
batches on that device.

``ImageDataModule`` is a ``LightningDataModule``. Its dataloaders yield ``(images, labels)`` with images uint8
(B, 3, H, W) and labels int64 (B,); ``on_after_batch_transfer`` turns them into float images normalised with
the training set's mean/std and, in training, applies the batched augmentation: random crop with zero padding,
horizontal flip, optional RandAugment (Cubuk et al. 2019, https://arxiv.org/abs/1909.13719, one draw of ops
per batch), mixup (Zhang et al. 2017, https://arxiv.org/abs/1710.09412) and cutmix (Yun et al. 2019,
https://arxiv.org/abs/1905.04899). With mixup/cutmix active the labels become (B, num_classes) float
probabilities.

Layouts of a data folder (``DataError``, a ``ValueError``, for anything else):

- ``DIR/train/<class>/<image>`` and ``DIR/test/<class>/<image>`` (ImageFolder); class names come from the
  folders of ``train/``; images of another size are resized (shorter side) and centre-cropped to ``img_size``.
  A non-image or unreadable file is skipped with a warning naming it (one bad file in 50,000 does not stop
  a run);
- ``DIR/cifar-10-batches-py`` (torchvision's CIFAR-10 python batches), or that folder itself.

The cache (one ``torch.save`` file) is written atomically (temporary file in the same folder, then
``os.replace``) and carries a CRC32 of its tensors and a fingerprint of the data files; a truncated, corrupt
or stale cache is rebuilt from the images, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import stat
import time
import warnings
import zlib
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
import torchvision
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from ...atomic import atomic_write
from ..device import synchronize

__all__ = [
    "DEFAULT_AUGMENT", "DataError", "ImageDataModule", "measure_throughput", "random_crop", "random_hflip",
]

log = logging.getLogger(__name__)

DEFAULT_AUGMENT = {
    "crop_padding": 4, "hflip": True, "randaugment": None, "mixup_alpha": 0.0, "cutmix_alpha": 0.0,
}
_RANDAUGMENT_DEFAULTS = {"num_ops": 2, "magnitude": 9}
_CACHE_VERSION = 1
_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
_CIFAR_TEST = ["test_batch"]
_CIFAR_META = "batches.meta"
_SPLITS = ("train", "test")


class DataError(ValueError):
    """The data cannot be found or read: a missing / empty / wrongly laid out folder, or no data offline."""


def _layout_error(root: Path, problem: str) -> DataError:
    return DataError(
        f"{problem}; expected {root}/train/<class>/<images> and {root}/test/<class>/<images> (ImageFolder) "
        f"or {root}/{_CIFAR_DIR} (CIFAR-10 python batches): pass --download (download=True) to fetch "
        f"CIFAR-10 there, or copy CIFAR-10 into {root}/{_CIFAR_DIR}"
    )


def _find_layout(root: Path, download: bool) -> tuple[str, Path]:
    """("imagefolder", root) or ("cifar", the cifar-10-batches-py folder); downloads only if asked."""
    if (root / "train").is_dir() and (root / "test").is_dir():
        return "imagefolder", root
    if (root / _CIFAR_DIR).is_dir():
        return "cifar", root / _CIFAR_DIR
    if root.name == _CIFAR_DIR and (root / _CIFAR_TRAIN[0]).is_file():
        return "cifar", root
    if download:
        _download_cifar10(root)
        return "cifar", root / _CIFAR_DIR
    if not root.exists():
        raise _layout_error(root, f"data folder {root} does not exist")
    entries = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    if not entries:
        raise _layout_error(root, f"data folder {root} is empty")
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    raise _layout_error(root, f"data folder {root} holds no dataset (found {shown})")


def _download_cifar10(root: Path) -> None:
    try:
        cifar = torchvision.datasets.CIFAR10
        torchvision.datasets.utils.download_and_extract_archive(cifar.url, str(root), filename=cifar.filename,
                                                                md5=cifar.tgz_md5)
    except (OSError, RuntimeError) as err:  # URLError is an OSError
        reason = " ".join(str(err).split())
        raise DataError(
            f"could not download CIFAR-10 into {root} ({type(err).__name__}: {reason}); copy CIFAR-10 into "
            f"{root}/{_CIFAR_DIR}, or pass a data folder holding train/<class>/ and test/<class>/ images"
        ) from err


def _class_folders(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]


def _list_imagefolder(root: Path) -> tuple[list[str], dict[str, tuple[list[Path], list[int]]]]:
    """Class names (the sorted folders of train/) and, per split, the sorted file paths with their labels."""
    class_names = sorted(_class_folders(root / "train"))
    if not class_names:
        raise _layout_error(root, f"{root}/train has no class folders")
    files: dict[str, tuple[list[Path], list[int]]] = {}
    for split in _SPLITS:
        unknown = sorted(set(_class_folders(root / split)) - set(class_names))
        if unknown:
            raise _layout_error(root, f"{root}/{split} has classes {unknown} that {root}/train lacks")
        paths, labels = [], []
        for label, name in enumerate(class_names):
            folder = root / split / name
            names = sorted(e.name for e in os.scandir(folder) if e.is_file() and not e.name.startswith(".")) \
                if folder.is_dir() else []
            paths += [folder / n for n in names]
            labels += [label] * len(names)
        if not paths:
            raise _layout_error(root, f"{root}/{split} holds no image files")
        files[split] = (paths, labels)
    return class_names, files


def _subset(n: int, limit: int | None, seed: int) -> torch.Tensor:
    """Sorted indices of a seeded random subset of ``min(n, limit)`` of ``range(n)`` (all if None)."""
    if limit is None or limit >= n:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:limit].sort().values


def _fit_size(image: torch.Tensor, img_size: int) -> torch.Tensor:
    """(3, h, w) uint8 -> (3, img_size, img_size): shorter side resized (antialiased), centre crop."""
    if image.shape[-2:] == (img_size, img_size):
        return image
    image = TF.resize(image, img_size, antialias=True)
    return TF.center_crop(image, [img_size, img_size])


def _decode_files(paths: list[Path], img_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode image files into (N_ok, 3, img_size, img_size) uint8 and the bool mask of files kept.

    A file that does not decode is skipped with a warning naming it."""
    images = torch.empty(len(paths), 3, img_size, img_size, dtype=torch.uint8)
    kept = torch.ones(len(paths), dtype=torch.bool)
    for i, path in enumerate(paths):
        try:
            images[i] = _fit_size(decode_image(str(path), mode=ImageReadMode.RGB), img_size)
        except (RuntimeError, OSError, ValueError) as err:
            reason = " ".join(str(err).split())
            warnings.warn(f"skipping {path}: not a readable image ({reason})", stacklevel=2)
            kept[i] = False
    return images[kept], kept


def _read_cifar_batches(batch_dir: Path) -> tuple[list[str], dict[str, tuple]]:
    """Read torchvision's CIFAR-10 python batches: class names and per split (images uint8, labels int64)."""
    def load(name: str) -> dict:
        path = batch_dir / name
        try:
            with open(path, "rb") as f:
                return pickle.load(f, encoding="latin1")
        except (OSError, pickle.UnpicklingError, EOFError, ValueError) as err:
            reason = f"cannot read {path} ({type(err).__name__}: {err})"
            raise _layout_error(batch_dir.parent, reason) from err

    class_names = list(load(_CIFAR_META)["label_names"])
    splits = {}
    for split, names in zip(_SPLITS, (_CIFAR_TRAIN, _CIFAR_TEST), strict=True):
        batches = [load(n) for n in names]
        data = np.concatenate([np.asarray(b["data"], dtype=np.uint8) for b in batches]).reshape(-1, 3, 32, 32)
        labels = torch.as_tensor(np.concatenate([b["labels"] for b in batches]), dtype=torch.int64)
        splits[split] = (torch.from_numpy(data), labels)
    return class_names, splits


def _fingerprint(layout: str, source: Path) -> str:
    """A hash of the data files: their names (ImageFolder) or names, sizes and mtimes (CIFAR batches)."""
    h = hashlib.sha1(layout.encode())
    if layout == "imagefolder":
        for split in _SPLITS:
            for folder in sorted(p for p in (source / split).iterdir() if p.is_dir()):
                h.update(f"{split}/{folder.name}:".encode())
                h.update("\0".join(sorted(e.name for e in os.scandir(folder))).encode())
    else:
        for name in [_CIFAR_META, *_CIFAR_TRAIN, *_CIFAR_TEST]:
            st = (source / name).stat()
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def _checksum(cache: dict) -> int:
    """CRC32 over the bytes of the cached image and label tensors."""
    crc = 0
    for split in _SPLITS:
        for key in (f"{split}_images", f"{split}_labels"):
            crc = zlib.crc32(cache[key].contiguous().numpy(), crc)
    return crc


def _channel_stats(images: torch.Tensor, chunk: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std of uint8 (N, 3, H, W) images, in [0, 1] units."""
    total = torch.zeros(3, dtype=torch.float64)
    squares = torch.zeros(3, dtype=torch.float64)
    for block in images.split(chunk):
        x = block.to(torch.float64)
        total += x.sum((0, 2, 3))
        squares += x.square().sum((0, 2, 3))
    count = images.numel() / images.shape[1]
    mean = total / count
    std = (squares / count - mean.square()).clamp_min(0).sqrt()
    return tuple((mean / 255).tolist()), tuple((std / 255).tolist())


def _writable(folder: Path) -> bool:
    """Whether we may write into ``folder``: permitted, and (for root, whom os.access always permits) its
    owner-write bit set, so a folder marked read-only stays untouched."""
    return os.access(folder, os.W_OK) and bool(folder.stat().st_mode & stat.S_IWUSR)


def _save_atomic(obj: dict, path: Path) -> None:
    """torch.save through zoo.atomic.atomic_write: never a half-written cache."""
    atomic_write(path, lambda f: torch.save(obj, f))


def random_crop(images: torch.Tensor, padding: int, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Random crop of (B, C, H, W) images after zero padding by ``padding`` on each side, one crop per image.

    ``offsets`` (B, 2) int64 (top, left) in [0, 2 * padding]; drawn uniformly when None. Vectorised: one
    ``gather`` of each image's H x W window from the flattened padded images, no loop over images."""
    if padding == 0:
        return images
    b, c, h, w = images.shape
    if offsets is None:
        offsets = torch.randint(0, 2 * padding + 1, (b, 2), device=images.device)
    padded = torch.nn.functional.pad(images, (padding,) * 4)  # (B, C, H + 2p, W + 2p)
    rows = offsets[:, 0, None] + torch.arange(h, device=images.device)  # (B, H)
    cols = offsets[:, 1, None] + torch.arange(w, device=images.device)  # (B, W)
    window = rows[:, :, None] * padded.shape[-1] + cols[:, None, :]  # (B, H, W) flat positions
    window = window.view(b, 1, h * w).expand(b, c, h * w)
    return padded.flatten(2).gather(2, window).view(b, c, h, w)


def random_hflip(images: torch.Tensor, flip: torch.Tensor | None = None) -> torch.Tensor:
    """Mirror (B, C, H, W) images left-right where ``flip`` (B,) bool is True (drawn with p = 0.5 if None)."""
    if flip is None:
        flip = torch.rand(images.shape[0], device=images.device) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


class _TensorBatches(Dataset):
    """Images uint8 (N, 3, H, W) and labels int64 (N,) in memory; ``__getitems__`` returns a whole batch as
    ``(images, labels)`` in one indexing op, so a plain (or Lightning's distributed) sampler drives it."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, device=self.labels.device)
        return self.images[index], self.labels[index]


def _as_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The collate function: ``__getitems__`` already returns a batch."""
    return batch


class ImageDataModule(pl.LightningDataModule):
    """CIFAR-10 or an ImageFolder tree as a uint8 tensor cache, with batched on-device augmentation.

    Args:
        data_dir: None -> ``./data`` with torchvision's CIFAR-10 (downloaded there if absent); else a folder
            in ImageFolder layout (train/ and test/ class folders) or one holding ``cifar-10-batches-py``.
            An explicit folder never downloads unless ``download=True``.
        download: fetch CIFAR-10 into ``data_dir`` when it holds no dataset.
        img_size: images are (3, img_size, img_size); other sizes are resized (shorter side), centre-cropped.
        batch_size / eval_batch_size: training / validation+test batch sizes (eval defaults to batch_size).
        val_size: training images held out for validation (a seeded random split).
        seed: seeds the split, the subsets and the shuffling order (same seed -> same order, epoch by epoch).
        augment: dict with keys of ``DEFAULT_AUGMENT`` overriding them (None -> crop padding 4 + hflip);
            ``randaugment`` is None or ``{"num_ops": 2, "magnitude": 9}``.
        cache_dir: where the cache file goes. Default: beside the data when the data folder is writable, else
            ``~/.cache/zoo/<hash of the data path>``.
        device_cache: "auto" (the trainer's root device when a trainer is attached, else CPU) or a device.
        max_train_images / max_test_images: seeded random subsets (only the chosen files are decoded).

    After ``setup``: ``num_classes``, ``class_names``, ``mean``, ``std`` (3-tuples in [0, 1] units, of the
    whole train split), ``img_size``, and the datasets ``train_dataset`` / ``val_dataset`` / ``test_dataset``
    (``.images`` uint8 (N, 3, H, W), ``.labels`` int64 (N,)).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        *,
        download: bool = False,
        img_size: int = 32,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        val_size: int = 5000,
        seed: int = 0,
        augment: dict | None = None,
        cache_dir: str | os.PathLike | None = None,
        device_cache: str | torch.device = "auto",
        max_train_images: int | None = None,
        max_test_images: int | None = None,
    ):
        super().__init__()
        sizes = {"img_size": img_size, "batch_size": batch_size, "eval_batch_size": eval_batch_size,
                 "val_size": val_size, "max_train_images": max_train_images,
                 "max_test_images": max_test_images}
        for name, value in sizes.items():
            low = 0 if name == "val_size" else 1
            if value is not None and (not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir) if data_dir is not None else Path("data")
        self.download = download or data_dir is None
        self.img_size = img_size
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.val_size = val_size
        self.seed = seed
        self.augment_config = _augment_config(augment)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        if device_cache != "auto":
            try:
                torch.device(device_cache)
            except RuntimeError as err:
                raise ValueError(f"device_cache must be 'auto' or a device, got {device_cache!r}") from err
        self.device_cache = device_cache
        self.max_train_images = max_train_images
        self.max_test_images = max_test_images
        self.num_classes: int | None = None
        self.class_names: list[str] | None = None
        self.mean: tuple[float, float, float] | None = None
        self.std: tuple[float, float, float] | None = None
        self.train_dataset = self.val_dataset = self.test_dataset = None
        self._cache: dict | None = None
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._shuffle = torch.Generator().manual_seed(seed)
        self._randaugment = _make_randaugment(self.augment_config["randaugment"])
        self._mix = None  # built once num_classes is known

    # ---------------------------------------------------------------- cache

    def cache_path(self, source: Path) -> Path:
        """The cache file for data read from ``source`` with this module's size and subset settings."""
        source = source.resolve()
        spec = [str(source), self.img_size, self.max_train_images, self.max_test_images,
                self.seed if (self.max_train_images or self.max_test_images) else None]
        name = "zoo-cache-" + hashlib.sha1(json.dumps(spec).encode()).hexdigest()[:12] + ".pt"
        if self.cache_dir is not None:
            return self.cache_dir / name
        if _writable(source):
            return source / name
        return Path.home() / ".cache" / "zoo" / hashlib.sha1(str(source).encode()).hexdigest()[:16] / name

    def prepare_data(self) -> None:
        """Find the data (downloading CIFAR-10 only where allowed) and build or validate the uint8 cache."""
        self._cache = self._load_or_build()

    def _load_or_build(self) -> dict:
        layout, source = _find_layout(self.data_dir, self.download)
        path = self.cache_path(source)
        fingerprint = _fingerprint(layout, source)
        cache = self._read_cache(path, fingerprint)
        if cache is not None:
            return cache
        start = time.perf_counter()
        cache = self._build(layout, source)
        cache["fingerprint"] = fingerprint
        cache["checksum"] = _checksum(cache)
        log.info("decoded %d + %d images from %s in %.1f s", len(cache["train_labels"]),
                 len(cache["test_labels"]), source, time.perf_counter() - start)
        try:
            _save_atomic(cache, path)
        except OSError as err:
            warnings.warn(f"could not write the data cache {path} ({err}); going on without it", stacklevel=2)
        return cache

    def _read_cache(self, path: Path, fingerprint: str) -> dict | None:
        """The cache at ``path`` if it is whole and current; None (with a warning if it was bad) otherwise."""
        if not path.is_file():
            return None
        try:
            cache = torch.load(path, weights_only=True)
            whole = cache["version"] == _CACHE_VERSION and cache["checksum"] == _checksum(cache)
        except Exception as err:  # a truncated / corrupt file fails in torch.load or zipfile in many ways
            whole, reason = False, f"{type(err).__name__}: {' '.join(str(err).split())}"
        else:
            reason = "version or checksum mismatch"
        if not whole:
            warnings.warn(f"data cache {path} is corrupt ({reason}); rebuilding it", stacklevel=3)
            return None
        if cache["fingerprint"] != fingerprint:
            warnings.warn(f"the data files changed since {path} was written; rebuilding it", stacklevel=3)
            return None
        return cache

    def _build(self, layout: str, source: Path) -> dict:
        limits = {"train": self.max_train_images, "test": self.max_test_images}
        cache: dict = {"version": _CACHE_VERSION}
        if layout == "imagefolder":
            class_names, files = _list_imagefolder(source)
            for offset, split in enumerate(_SPLITS):
                paths, labels = files[split]
                chosen = _subset(len(paths), limits[split], self.seed + offset).tolist()
                images, kept = _decode_files([paths[i] for i in chosen], self.img_size)
                if len(images) == 0:
                    raise _layout_error(source, f"no readable images in {source}/{split}")
                cache[f"{split}_images"] = images
                cache[f"{split}_labels"] = torch.tensor([labels[i] for i in chosen], dtype=torch.int64)[kept]
        else:
            class_names, splits = _read_cifar_batches(source)
            for offset, (split, (images, labels)) in enumerate(splits.items()):
                chosen = _subset(len(labels), limits[split], self.seed + offset)
                images = images[chosen]
                if images.shape[-1] != self.img_size:
                    images = TF.resize(images, [self.img_size, self.img_size], antialias=True)
                cache[f"{split}_images"], cache[f"{split}_labels"] = images.contiguous(), labels[chosen]
        cache["class_names"] = class_names
        cache["mean"], cache["std"] = _channel_stats(cache["train_images"])
        return cache

    # ---------------------------------------------------------------- setup and loaders

    def setup(self, stage: str | None = None) -> None:
        """Load the cache (building it if needed), split off the seeded validation set, move to the device."""
        if self._cache is None:
            self._cache = self._load_or_build()
        cache = self._cache
        self.class_names = list(cache["class_names"])
        self.num_classes = len(self.class_names)
        self.mean, self.std = tuple(cache["mean"]), tuple(cache["std"])
        self._stats.clear()
        self._mix = _make_mix(self.augment_config, self.num_classes)
        device = self._cache_device()
        if stage in (None, "fit", "validate"):
            n = len(cache["train_labels"])
            if self.val_size >= n:
                raise ValueError(f"val_size must be below the {n} training images, got {self.val_size}")
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
            val_idx, train_idx = order[: self.val_size].sort().values, order[self.val_size:].sort().values
            images, labels = cache["train_images"], cache["train_labels"]
            self.train_dataset = _TensorBatches(images[train_idx].to(device), labels[train_idx].to(device))
            self.val_dataset = _TensorBatches(images[val_idx].to(device), labels[val_idx].to(device))
        if stage in (None, "test", "predict"):
            images, labels = cache["test_images"], cache["test_labels"]
            self.test_dataset = _TensorBatches(images.to(device), labels.to(device))

    def _cache_device(self) -> torch.device:
        if self.device_cache != "auto":
            return torch.device(self.device_cache)
        if self.trainer is not None:
            return self.trainer.strategy.root_device
        return torch.device("cpu")

    def _loader(self, dataset: _TensorBatches | None, name: str, train: bool) -> DataLoader:
        if dataset is None:
            raise ValueError(f"the {name} split is not loaded: call setup() ('fit' or 'test') first")
        batch_size = self.batch_size if train else self.eval_batch_size
        return DataLoader(dataset, batch_size=batch_size, shuffle=train,
                          generator=self._shuffle if train else None,
                          drop_last=train and len(dataset) > batch_size, collate_fn=_as_batch, num_workers=0)

    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded; a new order each epoch) uint8 batches; the last incomplete batch is dropped."""
        return self._loader(self.train_dataset, "train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, "validation", train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_dataset, "test", train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_dataset, "test", train=False)

    # ---------------------------------------------------------------- transforms

    def _mean_std(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mean is None:
            raise ValueError("mean/std are unknown until prepare_data() or setup() has read the data")
        if device not in self._stats:
            self._stats[device] = tuple(torch.tensor(v, device=device).view(1, 3, 1, 1)
                                        for v in (self.mean, self.std))
        return self._stats[device]

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, 3, H, W) in [0, 255] (or float in [0, 1]) -> float32 ``(x / 255 - mean) / std``."""
        mean, std = self._mean_std(images.device)
        x = images.float() / 255 if images.dtype == torch.uint8 else images.float()
        return (x - mean) / std

    def denormalize(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised float (B, 3, H, W) -> float images in [0, 1] (for drawing)."""
        mean, std = self._mean_std(images.device)
        return (images * std + mean).clamp(0, 1)

    def augment(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training transform of a uint8 batch: crop, flip, RandAugment (uint8), normalise, mixup/cutmix.

        Returns float32 (B, 3, H, W) and labels: int64 (B,), or (B, num_classes) float probabilities when
        mixup/cutmix is active."""
        cfg = self.augment_config
        images = random_crop(images, cfg["crop_padding"])
        if cfg["hflip"]:
            images = random_hflip(images)
        if self._randaugment is not None:
            images = self._randaugment(images)
        images = self.normalize(images)
        if self._mix is not None:
            images, labels = self._mix(images, labels)
        return images, labels

    def on_after_batch_transfer(self, batch, dataloader_idx: int = 0):
        """On the batch's device: ``augment`` while the trainer trains, else only ``normalize``."""
        images, labels = batch
        if self.trainer is not None and self.trainer.training:
            return self.augment(images, labels)
        return self.normalize(images), labels


def _augment_config(augment: dict | None) -> dict:
    config = dict(DEFAULT_AUGMENT)
    unknown = sorted(set(augment or {}) - set(DEFAULT_AUGMENT))
    if unknown:
        raise ValueError(f"unknown augment keys {unknown}; expected some of {sorted(DEFAULT_AUGMENT)}")
    config.update(augment or {})
    if not isinstance(config["crop_padding"], int) or config["crop_padding"] < 0:
        raise ValueError(f"augment crop_padding must be an int >= 0, got {config['crop_padding']!r}")
    for key in ("mixup_alpha", "cutmix_alpha"):
        if not isinstance(config[key], (int, float)) or config[key] < 0:
            raise ValueError(f"augment {key} must be a number >= 0, got {config[key]!r}")
    return config


def _make_randaugment(spec: dict | bool | None) -> v2.RandAugment | None:
    if not spec:
        return None
    if spec is True:
        spec = {}
    unknown = sorted(set(spec) - set(_RANDAUGMENT_DEFAULTS))
    if unknown:
        expected = sorted(_RANDAUGMENT_DEFAULTS)
        raise ValueError(f"unknown randaugment keys {unknown}; expected some of {expected}")
    return v2.RandAugment(**{**_RANDAUGMENT_DEFAULTS, **spec})


def _make_mix(config: dict, num_classes: int):
    """torchvision's MixUp / CutMix (one of them at random per batch when both are on), or None."""
    mixes = [cls(alpha=float(config[key]), num_classes=num_classes)
             for cls, key in ((v2.MixUp, "mixup_alpha"), (v2.CutMix, "cutmix_alpha")) if config[key] > 0]
    if not mixes:
        return None
    return mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)


def measure_throughput(dm: ImageDataModule, num_batches: int = 50, *, train: bool = True,
                       device: str | torch.device | None = None, warmup: int = 3) -> float:
    """Images/s of the input pipeline alone: load a batch, move it to ``device``, augment (``train``) or only
    normalise. ``dm`` must be set up; its training loader is cycled as often as needed."""
    if dm.train_dataset is None:
        raise ValueError("measure_throughput needs a set-up data module: call dm.setup('fit') first")
    device = torch.device(device) if device is not None else dm.train_dataset.labels.device
    loader = dm.train_dataloader()
    per_epoch = len(loader)
    images_seen, start = 0, None
    for step in range(warmup + num_batches):
        if step % per_epoch == 0:
            batches = iter(loader)
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        images, labels = (t.to(device, non_blocking=True) for t in next(batches))
        out, _ = dm.augment(images, labels) if train else (dm.normalize(images), labels)
        images_seen += len(out) if step >= warmup else 0
    synchronize(device)
    return images_seen / max(time.perf_counter() - start, math.ulp(1.0))
