"""Several processes, as the zoo's commands meet them: the launcher that started this one (torchrun or SLURM, found
by Lightning's cluster environments), the number of processes a run trains on, the process group opened before a
run chooses anything (so rank 0 chooses its run directory and every rank receives the choice: ``on_rank_zero``), a
build that one process makes first and the others then find (``rank_zero_first``: the data cache), and a failure on
one rank that reaches every rank instead of leaving them waiting."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch

T = TypeVar("T")
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)


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


def external_environment():
    """torchrun's or SLURM's cluster environment when one of them started this process (Lightning's detection and
    order: torchrun first, it also runs inside SLURM), else None."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

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
    backend for the device; Fabric then finds it open and uses it). Returns whether one is open."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return True
    environment = external_environment()
    if environment is None or environment.world_size() <= 1:
        return False
    if accelerator == "gpu":
        torch.cuda.set_device(environment.local_rank())
    # where rank 0 listens, as the environment says (SLURM's node list and job id, torchrun's variables)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = environment.main_address, str(environment.main_port)
    # Lightning's timeout (30 min), not NCCL's 10: the other ranks wait in a collective while rank 0 builds the data
    torch.distributed.init_process_group("nccl" if accelerator == "gpu" else "gloo", rank=environment.global_rank(),
                                         world_size=environment.world_size(), timeout=PROCESS_GROUP_TIMEOUT)
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
