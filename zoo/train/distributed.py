"""What a run means on several processes (DESIGN's hardware contract): ``batch_size`` is the global batch, split
across the ranks (``split_batch``); the training sampler cuts one seeded permutation into global batches and gives
each rank its slice of every one (``GlobalBatchShard``), so the steps per epoch and the images of each optimizer step
do not depend on the world size; validation and test shards are unpadded (``ContiguousShard``), so with sum-reduced
metrics every image counts exactly once. Under an external launcher (torchrun, SLURM) the process group is opened
before the run directory is chosen, so rank 0 chooses and every rank receives the choice (``on_rank_zero``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from einops import rearrange
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from torch.utils.data import Dataset, DistributedSampler

T = TypeVar("T")


def split_batch(global_batch: int, world_size: int, what: str = "batch_size") -> int:
    """The per-rank share of ``global_batch``; ValueError (one line, naming the fix) when it does not divide."""
    if global_batch % world_size:
        low, high = global_batch // world_size * world_size, -(-global_batch // world_size) * world_size
        options = f"{low} or {high}" if low else str(high)
        raise ValueError(f"{what} {global_batch} is the global batch and must divide among the {world_size} "
                         f"processes (devices x nodes): give a multiple of {world_size}, e.g. {options}")
    return global_batch // world_size


def device_count(devices: int | str, accelerator: str) -> int:
    """Processes per node that Lightning starts for ``devices`` ("auto": every GPU, or one CPU process)."""
    if isinstance(devices, int) and devices >= 1:
        return devices
    if isinstance(devices, str) and devices != "auto":
        return len([d for d in devices.split(",") if d.strip()])
    if accelerator == "gpu":
        return torch.cuda.device_count()
    if accelerator == "mps":  # a Mac has one Apple GPU ("all" of them included)
        return 1
    return (os.cpu_count() or 1) if devices == -1 else 1


def external_environment() -> ClusterEnvironment | None:
    """torchrun's or SLURM's cluster environment when one of them started this process (Lightning's detection and
    order: torchrun first, it also runs inside SLURM), else None."""
    for environment in (TorchElasticEnvironment, SLURMEnvironment):
        if environment.detect():
            return environment()
    return None


def planned_world_size(devices: int | str, num_nodes: int, accelerator: str) -> int:
    """The number of processes the run trains on: the external launcher's world size, else devices x nodes."""
    environment = external_environment()
    return environment.world_size() if environment else device_count(devices, accelerator) * num_nodes


def open_process_group(accelerator: str) -> bool:
    """Under an external launcher with several processes, open the process group now, as Lightning's DDP would (its
    backend for the device; Lightning then finds it open and uses it). Returns whether one is open."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return True
    environment = external_environment()
    if environment is None or environment.world_size() <= 1:
        return False
    if accelerator == "gpu":
        torch.cuda.set_device(environment.local_rank())
    # Lightning's timeout (30 min), not NCCL's 10: the other ranks wait in a collective while rank 0 builds the data
    _init_dist_connection(environment, "nccl" if accelerator == "gpu" else "gloo", timeout=default_pg_timeout)
    return True


def is_global_zero() -> bool:
    """Whether this process is rank 0 of the run: of the open process group, else of Lightning's own launch
    (its child processes carry LOCAL_RANK / NODE_RANK)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return all(os.environ.get(name, "0") == "0" for name in ("LOCAL_RANK", "NODE_RANK"))


def on_rank_zero(choose: Callable[[], T]) -> T:
    """``choose()`` on rank 0 and its result on every rank of the open process group (``choose()`` alone when none
    is open). A failure on rank 0 reaches every rank (``_raise_on_every_rank``): no rank waits for one that failed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return choose()
    chosen, failure = [None], None
    if torch.distributed.get_rank() == 0:
        try:
            chosen = [choose()]
        except Exception as err:  # noqa: BLE001 (raised here as it was, and told to every other rank)
            failure = err
    _raise_on_every_rank(failure)
    torch.distributed.broadcast_object_list(chosen, src=0)
    return chosen[0]


def local_rank() -> int:
    """This process's rank on its machine: the external launcher's (torchrun, SLURM), else ``LOCAL_RANK``."""
    environment = external_environment()
    return environment.local_rank() if environment else int(os.environ.get("LOCAL_RANK", "0"))


def rank_zero_first(make: Callable[[], T]) -> T:
    """``make()`` on rank 0, then on the first process of every other machine, then on the other ranks: each finds
    what the one before it built (a data cache, say), and a machine that does not share rank 0's file system builds
    its own copy once, not once per process. A failure in ``make()`` reaches every rank (``_raise_on_every_rank``).
    ``make()`` alone when no process group is open."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return make()
    made = []
    for my_turn in (torch.distributed.get_rank() == 0, local_rank() == 0, True):
        failure = None
        if my_turn and not made:
            try:
                made.append(make())
            except Exception as err:  # noqa: BLE001 (raised here as it was, and told to every other rank)
                failure = err
        _raise_on_every_rank(failure)
    return made[0]


def _raise_on_every_rank(failure: Exception | None) -> None:
    """A collective: ``failure`` raised on its own rank and, on every other one, a ValueError with its message
    (a ValueError) or a RuntimeError naming the rank and the exception (anything else); nothing where no rank
    failed."""
    told: list = [None] * torch.distributed.get_world_size()
    summary = None if failure is None else (isinstance(failure, ValueError), f"{type(failure).__name__}: {failure}",
                                            str(failure), torch.distributed.get_rank())
    torch.distributed.all_gather_object(told, summary)
    if failure is not None:
        raise failure
    for is_value_error, named, message, rank in filter(None, told):
        raise ValueError(message) if is_value_error else RuntimeError(f"rank {rank} failed: {named}")


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
