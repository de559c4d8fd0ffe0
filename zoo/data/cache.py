"""The decoded-data cache: one ``torch.save`` file holding the uint8 images and int64 labels of both splits,
the class names, the training split's per-channel mean and std, a fingerprint of the data files and a CRC32
of the tensors. It lives in the user cache directory (``$XDG_CACHE_HOME/zoo``, else ``~/.cache/zoo``), in a
folder named by a hash of the data path, or in an explicit ``cache_dir``, and never in the data folder. It is
written atomically (zoo.atomic: a temporary file in the same folder, then ``os.replace``) and read through a
memory map (what the streamed data path reads its batches from); a truncated,
corrupt or stale cache is rebuilt from the data files, with a warning."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
import zlib
from pathlib import Path

import torch

from ..atomic import atomic_write
from .cifar import batch_files
from .decode import Limits, decode_splits
from .layout import SPLITS

log = logging.getLogger(__name__)

CACHE_VERSION = 1


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/zoo`` when that variable holds an absolute path (the XDG rule), else ``~/.cache/zoo``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return root / "zoo"


def cache_path(source: Path, cache_dir: Path | None, img_size: int, limits: Limits, seed: int) -> Path:
    """The cache file for data read from ``source`` at ``img_size`` with the subsets ``limits`` (drawn with
    ``seed``): in ``cache_dir`` if given, else in ``user_cache_dir()/<hash of source>``. A ``cache_dir`` that
    is an existing file -> ValueError (a cache silently not written would decode the data on every run)."""
    if cache_dir is not None and cache_dir.exists() and not cache_dir.is_dir():
        raise ValueError(f"cache_dir {cache_dir} is a file, not a folder: pass a folder for the decoded-data cache")
    source = source.resolve()
    subsets = limits["train"] or limits["test"]
    spec = [str(source), img_size, limits["train"], limits["test"], seed if subsets else None]
    name = "zoo-cache-" + hashlib.sha1(json.dumps(spec).encode()).hexdigest()[:12] + ".pt"
    if cache_dir is not None:
        return cache_dir / name
    return user_cache_dir() / hashlib.sha1(str(source).encode()).hexdigest()[:16] / name


def _file_key(name: str, st: os.stat_result) -> bytes:
    """What identifies one data file's content without reading it: its name, size, modification time, and the
    inode and status-change time (ctime), which a program cannot set: any write to the file, or a rename onto its
    name (two files of one size and mtime swapped between class folders), changes them."""
    return f"{name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}\0".encode()


def data_fingerprint(layout: str, source: Path) -> str:
    """A hash of the data files' keys (``_file_key``: ImageFolder files and CIFAR batches), so contents replaced or
    moved under the same names rebuild the cache."""
    h = hashlib.sha1(layout.encode())
    if layout == "imagefolder":
        for split in SPLITS:
            for folder in sorted(p for p in (source / split).iterdir() if p.is_dir()):
                h.update(f"{split}/{folder.name}:".encode())
                entries = sorted((e for e in os.scandir(folder) if e.is_file()), key=lambda e: e.name)
                for entry in entries:
                    h.update(_file_key(entry.name, entry.stat()))  # stat follows links, as the decoder does
    else:
        for path in batch_files(source):
            h.update(_file_key(path.name, path.stat()))
    return h.hexdigest()


def checksum(cache: dict) -> int:
    """CRC32 over the bytes of the cached image and label tensors."""
    crc = 0
    for split in SPLITS:
        for key in (f"{split}_images", f"{split}_labels"):
            crc = zlib.crc32(cache[key].contiguous().numpy(), crc)
    return crc


def channel_stats(images: torch.Tensor, chunk: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
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


def read_cache(path: Path, expected_fingerprint: str) -> dict | None:
    """The cache at ``path`` if it is whole and current; None (with a warning if it was bad) otherwise."""
    if not path.is_file():
        return None
    try:
        cache = torch.load(path, weights_only=True, mmap=True)  # mapped: pages are read as they are used
        whole = cache["version"] == CACHE_VERSION and cache["checksum"] == checksum(cache)
    except Exception as err:  # a truncated / corrupt file fails in torch.load or zipfile in many ways
        whole, reason = False, f"{type(err).__name__}: {' '.join(str(err).split())}"
    else:
        reason = "version or checksum mismatch"
    if not whole:
        warnings.warn(f"data cache {path} is corrupt ({reason}); rebuilding it", stacklevel=3)
        return None
    if cache["fingerprint"] != expected_fingerprint:
        warnings.warn(f"the data files changed since {path} was written; rebuilding it", stacklevel=3)
        return None
    return cache


def write_cache(cache: dict, path: Path) -> None:
    """Write ``cache`` atomically (never a half-written file); a failed write warns and leaves what was there."""
    try:
        atomic_write(path, lambda f: torch.save(cache, f))
    except OSError as err:
        warnings.warn(f"could not write the data cache {path} ({err}); going on without it", stacklevel=3)


def build_cache(layout: str, source: Path, img_size: int, limits: Limits, seed: int, fingerprint: str) -> dict:
    """Decode the data and add what the cache keeps beside it: version, statistics, the ``fingerprint`` of the
    data files (taken before decoding), checksum."""
    start = time.perf_counter()
    cache = {"version": CACHE_VERSION, **decode_splits(layout, source, img_size, limits, seed)}
    decoded_train = len(cache["train_labels"]) > 0  # a test-only cache (train limit 0) has no statistics
    cache["mean"], cache["std"] = channel_stats(cache["train_images"]) if decoded_train else (None, None)
    cache["fingerprint"] = fingerprint
    cache["checksum"] = checksum(cache)
    log.info("decoded %d + %d images from %s in %.1f s", len(cache["train_labels"]),
             len(cache["test_labels"]), source, time.perf_counter() - start)
    return cache


def load_or_build(layout: str, source: Path, path: Path, img_size: int, limits: Limits, seed: int) -> dict:
    """The cache at ``path`` if it is whole and matches the data files, else built from them and written."""
    fingerprint = data_fingerprint(layout, source)
    cache = read_cache(path, fingerprint)
    if cache is None:
        print(f"decoding the images of {source} into the data cache {path} (once: later runs read the cache)",
              flush=True)
        cache = build_cache(layout, source, img_size, limits, seed, fingerprint)
        write_cache(cache, path)
    return cache
