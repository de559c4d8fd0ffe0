"""Testable anywhere: tests that need CIFAR-10 find it in the documented order (``ZOO_DATA_DIR``, then
``../shared/data/cifar10``, then ``./data``), are skipped with the reason where there is none, and fail -- never
skip -- when ``ZOO_DATA_DIR`` names a folder without it (what CI relies on). The places to look are pointed at
empty temporary folders, so this runs the same with or without the real data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.fixture
def conftest(monkeypatch, tmp_path):
    """tests/conftest.py as pytest loaded it, with ZOO_DATA_DIR unset and both default places empty."""
    module = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(CONFTEST))
    monkeypatch.delenv(module.DATA_ENV, raising=False)
    monkeypatch.setattr(module, "CANDIDATES", (tmp_path / "shared" / "data" / "cifar10", tmp_path / "data"))
    return module


def image_folders(root: Path) -> Path:
    for split in ("train", "test"):
        (root / split / "cat").mkdir(parents=True)
    return root


def batches_download(root: Path) -> Path:
    (root / "cifar-10-batches-py").mkdir(parents=True)
    (root / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    return root


def test_no_data_anywhere_skips_with_the_reason(conftest):
    assert conftest.find_cifar10() is None
    with pytest.raises(pytest.skip.Exception, match="no CIFAR-10 found: set ZOO_DATA_DIR") as info:
        conftest.require_cifar10()
    assert all(str(place) in str(info.value) for place in conftest.CANDIDATES)


def test_places_are_searched_in_the_documented_order(conftest, tmp_path, monkeypatch):
    shared, local = conftest.CANDIDATES
    batches_download(local)
    assert conftest.require_cifar10() == local
    image_folders(shared)
    assert conftest.require_cifar10() == shared
    monkeypatch.setenv("ZOO_DATA_DIR", str(image_folders(tmp_path / "mine")))
    assert conftest.require_cifar10() == tmp_path / "mine"


def test_zoo_data_dir_without_cifar10_fails_even_when_a_default_place_has_it(conftest, tmp_path, monkeypatch):
    image_folders(conftest.CANDIDATES[0])
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / "empty"))
    with pytest.raises(pytest.fail.Exception, match=r"ZOO_DATA_DIR=.*empty holds no CIFAR-10"):
        conftest.require_cifar10()


@pytest.mark.slow  # pytest in a subprocess; the default suite tests require_cifar10's error in-process above
def test_a_data_test_run_with_an_empty_zoo_data_dir_fails_naming_it(tmp_path):
    """End to end: pytest itself, on a real data-needing test, reports the error instead of skipping."""
    env = {**os.environ, "ZOO_DATA_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    test = "tests/train/test_learning.py::test_max_time_fits_the_schedule_and_still_tests"  # in the default suite
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", test], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:]
    assert f"ZOO_DATA_DIR={tmp_path} holds no CIFAR-10" in done.stdout and "1 error" in done.stdout
    assert "skipped" not in done.stdout
