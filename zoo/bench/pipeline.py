"""Speed of the input pipeline alone: batches of a set-up ``zoo.data.ImageData`` loaded, moved
to a device and augmented (or only normalised), in images/s, with no model in the loop."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from ..runtime.timing import synchronize

if TYPE_CHECKING:
    from ..data import ImageData


def measure_throughput(dm: ImageData, num_batches: int = 50, *, train: bool = True,
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
