"""The global random generators as data: ``random_states`` (torch's CPU generator and the current GPU's or Apple
GPU's, where augmentation and dropout draw, Python's and NumPy's) as tensors and plain values that
``torch.load(weights_only=True)`` reads back, ``set_random_states`` to put them back (exact resume), and
``forked_generators`` (a block that draws from its own seed and leaves the generators as they were)."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


def random_states() -> dict:
    """Every global generator's state. On a GPU, this process's own GPU only: the augmentation draws for the
    whole global batch on every rank from one seed, so every rank's generators stay equal to rank 0's."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    if torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_random_states(state: dict) -> None:
    """Put back what ``random_states`` returned (a GPU's or Apple GPU's only where this machine has one)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])


@contextlib.contextmanager
def forked_generators(device: torch.device, seed: int):
    """torch's CPU generator and ``device``'s alone (no other GPU's) seeded with ``seed`` inside the block, set back
    as they were after."""
    accelerator = [] if device.type == "cpu" else [device.index or 0]
    with torch.random.fork_rng(devices=accelerator, device_type="cuda" if device.type == "cpu" else device.type):
        torch.manual_seed(seed)
        yield
