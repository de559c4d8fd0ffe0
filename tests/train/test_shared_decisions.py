"""Decisions every rank shares (the time limit, a timed checkpoint, a stop on a signal) cost a collective, and on a
GPU a host sync, each time they are made. Under several processes they are made every ``decide_every`` optimizer
steps (``zoo.train.device.host_sync_every``: each step on a CPU, every 50th on a GPU), at steps all ranks reach
together; one process decides at every step, where no collective is needed.

A real Lightning fit in one process whose strategy reports a world size of 2 and counts the collectives the
callbacks' batch-end hooks make (each returns what one rank would get). The GPU's generator is faked: in rank 0's
process the other GPUs' generators are seeded but never drawn from."""

from __future__ import annotations

import signal
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import SingleDeviceStrategy

from zoo.train.callbacks import StepTimer, TimedCheckpoint
from zoo.train.preemption import Preempted, PreemptionCheckpoint, RandomStates

EVERY = 5


class CountingStrategy(SingleDeviceStrategy):
    """One process standing for rank 0 of ``world_size``; records the global step of each collective made while
    the training batch-end hooks run."""

    def __init__(self, world_size: int):
        super().__init__(device=torch.device("cpu"))
        self.world_size, self.collectives, self.in_batch_end = world_size, [], False

    def _record(self):
        if self.in_batch_end:
            self.collectives.append(self.lightning_module.trainer.global_step)

    def broadcast(self, obj, src: int = 0):
        self._record()
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self._record()
        return decision


class BatchEndMarker(pl.Callback):
    """First in the list: marks the batch-end hooks of the callbacks after it (and signals at ``signal_at``)."""

    def __init__(self, preemption: PreemptionCheckpoint | None = None, signal_at: int | None = None):
        self.preemption, self.signal_at = preemption, signal_at

    def on_train_batch_start(self, trainer, *args):
        trainer.strategy.in_batch_end = False

    def on_train_batch_end(self, trainer, *args):
        trainer.strategy.in_batch_end = True
        if self.preemption is not None and trainer.global_step == self.signal_at:
            self.preemption.signum = signal.SIGTERM  # what its handler records


def fit(tmp_path, world_size: int, callbacks: list, steps: int = 20, marker=None) -> tuple[pl.Trainer, list]:
    strategy = CountingStrategy(world_size)
    trainer = pl.Trainer(strategy=strategy, max_steps=steps, limit_val_batches=0, callbacks=[marker or
                         BatchEndMarker(), *callbacks], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    return trainer, strategy.collectives


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_time_limit_and_the_timed_checkpoint_decide_every_few_steps_under_several_processes(tmp_path, world_size):
    checkpoint = TimedCheckpoint(tmp_path, "last", train_time_interval=timedelta(0), enable_version_counter=False,
                                 decide_every=EVERY)
    trainer, collectives = fit(tmp_path, world_size, [checkpoint, StepTimer(timedelta(hours=1), EVERY)])
    deciding = list(range(1, 21)) if world_size == 1 else list(range(EVERY, 21, EVERY))
    assert sorted(set(collectives)) == deciding
    assert trainer.global_step == 20
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 20 and "Timer" in saved["callbacks"]  # the key of Trainer(max_time)'s Timer


@pytest.mark.parametrize("world_size, stop", [(1, 1), (2, EVERY)])
def test_a_spent_time_limit_stops_on_the_next_deciding_step(tmp_path, world_size, stop):
    trainer, _ = fit(tmp_path, world_size, [StepTimer(timedelta(microseconds=1), EVERY)])  # spent by the first step
    assert trainer.global_step == stop


@pytest.mark.parametrize("world_size, saved_at", [(1, 7), (2, 10)])
def test_a_signal_stops_every_rank_on_the_next_deciding_step(tmp_path, world_size, saved_at):
    preemption = PreemptionCheckpoint(tmp_path / "last.ckpt", decide_every=EVERY)
    with pytest.raises(Preempted) as stopped:
        fit(tmp_path, world_size, [preemption], marker=BatchEndMarker(preemption, signal_at=7))
    assert stopped.value.step == saved_at
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == saved_at


class FakeGpus:
    """torch.cuda's generator functions over fake per-GPU states, in a process whose current GPU is ``current``."""

    def __init__(self, states: dict[int, torch.Tensor], current: int):
        self.states, self.current = states, current

    def install(self, monkeypatch):
        for name in ("is_available", "is_initialized"):
            monkeypatch.setattr(torch.cuda, name, lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.states))
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[self.current].clone())
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [self.states[i] for i in sorted(self.states)])
        monkeypatch.setattr(torch.cuda, "set_rng_state", self._set)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: self.states.update(enumerate(states)))

    def _set(self, state, device="cuda"):
        self.states[self.current] = state.clone()


def test_each_rank_resumes_its_own_gpus_generator_from_what_rank_0_drew(monkeypatch):
    seeded, drawn = torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([9, 9], dtype=torch.uint8)
    FakeGpus({0: drawn, 1: seeded}, current=0).install(monkeypatch)  # rank 0: GPU 1 seeded, never drawn from
    saved = RandomStates().state_dict()
    rank1 = FakeGpus({0: seeded, 1: seeded}, current=1)  # rank 1 after a restart, before the checkpoint loads
    rank1.install(monkeypatch)
    RandomStates().load_state_dict(saved)
    assert torch.equal(rank1.states[1], drawn)  # as far on as rank 1's own generator was when the run stopped
    old = {**saved, "cuda": [drawn, seeded]}  # a checkpoint written with every GPU's state
    rank0 = FakeGpus({0: seeded}, current=0)
    rank0.install(monkeypatch)
    RandomStates().load_state_dict(old)
    assert torch.equal(rank0.states[0], drawn)


def test_an_apple_gpus_generator_is_saved_and_set_again(monkeypatch):
    states = {"mps": torch.tensor([1, 2], dtype=torch.uint8)}
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda device="mps": states["mps"].clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state, device="mps": states.update(mps=state.clone()))
    saved = RandomStates().state_dict()
    states["mps"] = torch.tensor([7, 7], dtype=torch.uint8)  # drawn from after the checkpoint
    RandomStates().load_state_dict(saved)
    assert torch.equal(states["mps"], torch.tensor([1, 2], dtype=torch.uint8))
