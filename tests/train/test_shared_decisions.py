"""Decisions every rank shares (a signal, the budget's step count, a timed checkpoint, a non-finite loss) cost a
collective, and on a GPU a host sync, each time they are made. Under several processes they are made every
``host_sync_every`` optimizer steps (each step on a CPU, every 50th on a GPU) and at each epoch's end, steps all
ranks reach together; one process decides at every step and makes no collective.

The real loop in one process, on a Fabric that reports a world size of 2 and records the step of each collective
the loop makes (each returns what one rank would get). The GPU's generator is faked: in rank 0's process the other
GPUs' generators are seeded but never drawn from."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from lightning.fabric import Fabric

from zoo.runtime.random import random_states, set_random_states
from zoo.train import loop

EVERY = 5
STEPS = 12  # 2 epochs of 6 steps


class CountingFabric(Fabric):
    """Fabric in one process standing for rank 0 of ``world_size``: the step of every collective is recorded."""

    def __init__(self, world_size: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ranks, self.collectives, self.run = world_size, [], None

    @property
    def world_size(self) -> int:
        return self.ranks

    def _record(self):
        if self.run is not None:
            self.collectives.append(self.run.position.step)

    def all_reduce(self, data, group=None, reduce_op="mean"):
        self._record()
        return data

    def broadcast(self, obj, src: int = 0):
        self._record()
        return obj


class Watcher:
    """Hands the run to the fabric (to read its step) and sends SIGTERM to this process at ``signal_at``."""

    def __init__(self, signal_at: int | None = None):
        self.signal_at = signal_at

    def on_train_start(self, run):
        run.fabric.run = run

    def on_train_batch_end(self, run):
        if run.position.step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory, image_tree_writer):
    return image_tree_writer(tmp_path_factory.mktemp("tree"), 16, counts=(("train", 6), ("test", 1)))


def train(run_train, image_tree, tmp_path, monkeypatch, world_size: int, signal_at: int | None = None):
    fabrics = []

    def counting_fabric(plan, callbacks):
        fabric = CountingFabric(world_size, accelerator="cpu", devices=1, precision="32-true",
                                callbacks=[*callbacks, Watcher(signal_at)])
        fabrics.append(fabric)
        return fabric

    monkeypatch.setattr(loop, "make_fabric", counting_fabric)
    monkeypatch.setattr(loop, "host_sync_every", lambda device_type: EVERY)  # as on a GPU, every few steps
    done = run_train(["--model", "vit_nano", "--data-dir", image_tree, "--epochs", "2", "--batch-size", "8",
                             "--set", "val_size=12", "--precision", "32", "--set", "model_args.depth=1",
                             "--set", "model_args.embed_dim=32", "--ckpt-every-n-steps", "1000",
                             "--ckpt-every-minutes", "0", "--out", tmp_path / "runs", "--cache-dir",
                             tmp_path / "cache"])
    return done, fabrics[0]


@pytest.mark.parametrize("world_size", [1, 2])
def test_decisions_are_made_every_few_steps_and_at_epoch_ends_under_several_processes(run_train, image_tree, tmp_path,
                                                                                     monkeypatch, world_size):
    done, fabric = train(run_train, image_tree, tmp_path, monkeypatch, world_size)
    assert done.returncode == 0, done.stderr[-2000:]
    in_training = sorted({step for step in fabric.collectives if 0 < step < STEPS})
    # 6 steps an epoch: the deciding steps are 5 and 10 and the epoch ends 6 and 12 (the epoch totals and the
    # validation's are summed there too); one process makes none
    assert in_training == ([] if world_size == 1 else [5, 6, 10])


@pytest.mark.parametrize("world_size, saved_at", [(1, 7), (2, 10)])
def test_a_signal_stops_every_rank_on_the_next_deciding_step(run_train, image_tree, tmp_path, monkeypatch,
                                                             world_size, saved_at):
    done, _ = train(run_train, image_tree, tmp_path, monkeypatch, world_size, signal_at=7)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    (run,) = (tmp_path / "runs" / "vit_nano").iterdir()
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == saved_at


class FakeGpus:
    """torch.cuda's generator functions over fake per-GPU states, in a process whose current GPU is ``current``."""

    def __init__(self, states: dict[int, torch.Tensor], current: int):
        self.states, self.current = states, current

    def install(self, monkeypatch):
        for name in ("is_available", "is_initialized"):
            monkeypatch.setattr(torch.cuda, name, lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.states))
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[self.current].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", self._set)

    def _set(self, state, device="cuda"):
        self.states[self.current] = state.clone()


def test_each_rank_resumes_its_own_gpus_generator_from_what_rank_0_drew(monkeypatch):
    seeded, drawn = torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([9, 9], dtype=torch.uint8)
    FakeGpus({0: drawn, 1: seeded}, current=0).install(monkeypatch)  # rank 0: GPU 1 seeded, never drawn from
    saved = random_states()
    rank1 = FakeGpus({0: seeded, 1: seeded}, current=1)  # rank 1 after a restart, before the checkpoint loads
    rank1.install(monkeypatch)
    set_random_states(saved)
    assert torch.equal(rank1.states[1], drawn)  # as far on as rank 1's own generator was when the run stopped


def test_an_apple_gpus_generator_is_saved_and_set_again(monkeypatch):
    states = {"mps": torch.tensor([1, 2], dtype=torch.uint8)}
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda device="mps": states["mps"].clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state, device="mps": states.update(mps=state.clone()))
    saved = random_states()
    states["mps"] = torch.tensor([7, 7], dtype=torch.uint8)  # drawn from after the checkpoint
    set_random_states(saved)
    assert torch.equal(states["mps"], torch.tensor([1, 2], dtype=torch.uint8))
