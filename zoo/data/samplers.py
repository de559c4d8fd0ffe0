"""Which images each optimizer step trains on, whatever the number of processes: ``batch_size`` is the global
batch, split across the ranks (``split_batch``); the training sampler cuts one seeded permutation into global batches
and gives each rank its slice of every one (``GlobalBatchShard``), so the steps per epoch and the images of each
optimizer step do not depend on the world size; validation and test shards are unpadded (``ContiguousShard``), so
with sum-reduced metrics every image counts exactly once. ``EpochOrder`` says where the data order stands (the
shuffle generator's state when the epoch's permutation was drawn, and the batches of it already trained on), which a
checkpoint holds so a resumed run draws the same batches as the uninterrupted one."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from einops import rearrange
from torch.utils.data import Dataset, DistributedSampler


def split_batch(global_batch: int, world_size: int, what: str = "batch_size") -> int:
    """The per-rank share of ``global_batch``; ValueError (one line, naming the fix) when it does not divide."""
    if global_batch % world_size:
        low, high = global_batch // world_size * world_size, -(-global_batch // world_size) * world_size
        options = f"{low} or {high}" if low else str(high)
        raise ValueError(f"{what} {global_batch} is the global batch and must divide among the {world_size} "
                         f"processes (devices x nodes): give a multiple of {world_size}, e.g. {options}")
    return global_batch // world_size




class GlobalBatchShard(DistributedSampler):
    """Rank ``rank``'s images of each global batch: every epoch one permutation of the dataset drawn from
    ``generator`` (the same on every rank) is cut into global batches of ``global_batch`` (an incomplete last one
    dropped, unless the dataset is smaller than one batch), and each is split into ``num_replicas`` equal slices.
    With one replica it yields what ``RandomSampler(generator=generator)`` + ``drop_last`` do. ``skip`` (called once
    per epoch) gives the global batches at the start of the permutation to leave out (a resumed epoch's). A
    DistributedSampler, so Lightning does not replace it."""

    def __init__(self, dataset: Dataset, global_batch: int, num_replicas: int, rank: int,
                 generator: torch.Generator, skip: Callable[[], int] | None = None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, drop_last=True)
        self.global_batch, self.generator, self.skip = global_batch, generator, skip
        n = len(dataset)
        self.local_batch = split_batch(global_batch, num_replicas)
        # a split smaller than one batch trains on one batch of what divides among the ranks
        self.used = n // global_batch * global_batch if n >= global_batch else n // num_replicas * num_replicas

    def __len__(self) -> int:
        return self.used // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(len(self.dataset), generator=self.generator)[: self.used]
        share = min(self.local_batch, self.used // self.num_replicas)
        # this rank's slice of every global batch, step after step
        shards = rearrange(order, "(step rank image) -> rank (step image)", rank=self.num_replicas, image=share)
        skip = self.skip() * share if self.skip is not None else 0  # a resumed epoch's batches already trained on
        return iter(shards[self.rank, skip:].tolist())


class ContiguousShard(DistributedSampler):
    """Rank ``rank``'s contiguous, unpadded share of the dataset in order (sizes differ by at most one image), so
    evaluation over all ranks sees each image exactly once. A DistributedSampler, so Lightning does not replace it."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        n = len(dataset)
        self.start, self.stop = rank * n // num_replicas, (rank + 1) * n // num_replicas

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))


class EpochOrder:
    """Where the training data order stands: the shuffle ``generator``'s state when the current epoch's loader
    iterator was created (everything the epoch draws from it follows from that state) and, after a resume, the
    global batches of that epoch already trained on, which the sampler skips once."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.epoch_state: torch.Tensor | None = None
        self._resume: tuple[torch.Tensor, int] | None = None
        self._skip = 0

    def start_epoch(self) -> None:
        """Called as the training loader's iterator is created, before anything is drawn for the epoch."""
        if self._resume is not None:
            state, self._skip = self._resume
            self.generator.set_state(state)
            self._resume = None
        self.epoch_state = self.generator.get_state()

    def take_skip(self) -> int:
        """Global batches of this epoch to leave out (once, after a resume), for the sampler."""
        skip, self._skip = self._skip, 0
        return skip

    def state_dict(self, batches_done: int, epoch_done: bool) -> dict:
        if epoch_done or self.epoch_state is None:  # the next epoch starts from the generator as it is now
            return {"generator": self.generator.get_state(), "skip": 0}
        return {"generator": self.epoch_state, "skip": int(batches_done)}

    def load_state_dict(self, state: dict) -> None:
        self._resume = (state["generator"], int(state["skip"]))
