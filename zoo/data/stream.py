"""Data that does not fit on the device: whether the decoded images may be resident there (``stream_needed``,
against a budget given in GiB or measured: half the device's free memory) and, when they may not, a Dataset that
reads batches from the memory-mapped cache file (``MappedBatches``) in DataLoader workers. The batches are the
resident path's, row for row (the same uint8 images, labels and alternating flip); the trainer copies them to the
device (from pinned memory on CUDA) and the same on-device augmentation runs after the copy."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

from .augment import AlternatingFlip

# the decoded images may take this share of the device's free memory: the model, its activations and the
# optimizer state need the rest
RESIDENT_SHARE = 0.5


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` (host memory for the CPU); None where it cannot be measured."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        if device.type == "mps":
            return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
        if device.type == "cpu":
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError, RuntimeError):
        pass
    return None


def stream_needed(nbytes: int, device: torch.device, budget_gib: float | None) -> bool:
    """Whether ``nbytes`` of decoded images exceed the budget on ``device``: ``budget_gib`` GiB, or (None)
    ``RESIDENT_SHARE`` of its measured free memory (resident when it cannot be measured)."""
    if budget_gib is None:
        free = free_memory(device)
        return free is not None and nbytes > RESIDENT_SHARE * free
    return nbytes > budget_gib * 2**30


class _FixedEpoch:
    """A picklable stand-in for the trainer's epoch: the one a worker's loader started in."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def __call__(self) -> int:
        return self.epoch


class MappedBatches(Dataset):
    """One split's rows of the cache file at ``path``, read through a memory map (``torch.load(mmap=True)``):
    ``__getitems__`` returns a whole batch ``(uint8 images (B, 3, H, W), int64 labels (B,))`` as the resident
    dataset does. ``rows`` (int64) picks the split's rows of ``<split>_images`` (None: all of them, in order);
    ``flip`` mirrors images by dataset row, as in the resident path. Each process (DataLoader workers too) opens
    the map itself: pickling the dataset never copies the images.

    ``images`` materialises the split (the whole tensor; file-backed when ``rows`` is None) for the few callers
    that want it at once; ``dataset[a:b]`` reads only those rows."""

    def __init__(self, path: Path, split: str, rows: torch.Tensor | None, labels: torch.Tensor,
                 flip: AlternatingFlip | None = None):
        self.path, self.split, self.rows, self.labels, self.flip = Path(path), split, rows, labels, flip
        self._mapped: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__, _mapped=None)  # a worker maps the file itself
        if self.flip is not None:  # a spawned worker has no trainer: it gets the epoch its loader started in
            state["flip"] = copy.copy(self.flip)
            state["flip"].epoch = _FixedEpoch(self.flip.epoch())
        return state

    def _source(self) -> torch.Tensor:
        if self._mapped is None:
            self._mapped = torch.load(self.path, mmap=True, weights_only=True)[f"{self.split}_images"]
        return self._mapped

    def _read(self, index: torch.Tensor) -> torch.Tensor:
        return self._source()[index if self.rows is None else self.rows[index]]

    @property
    def images(self) -> torch.Tensor:
        return self._source() if self.rows is None else self._source()[self.rows]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int | slice) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(index, slice):
            index = torch.arange(len(self))[index]
        return self._read(torch.as_tensor(index)), self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(indices)
        images = self._read(index)
        return (images if self.flip is None else self.flip(images, index)), self.labels[index]
