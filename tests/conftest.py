"""Shared fixtures. Real CIFAR-10 JPEGs lie in ../shared/data/cifar10 beside the checkout (CI too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CIFAR_DIR = REPO.parent / "shared" / "data" / "cifar10"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def cifar_dir() -> Path:
    """The real CIFAR-10 ImageFolder tree (read-only): train/<class>/NNNN.jpg, test/<class>/NNNN.jpg."""
    if not (CIFAR_DIR / "train").is_dir():
        pytest.fail(f"real CIFAR-10 expected at {CIFAR_DIR} (train/ and test/ class folders)")
    return CIFAR_DIR
