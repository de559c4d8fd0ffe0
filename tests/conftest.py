"""Shared fixtures. Tests that need real CIFAR-10 take the ``cifar_dir`` fixture, which finds it in one
documented order: the ``ZOO_DATA_DIR`` environment variable, then ``../shared/data/cifar10`` beside the
checkout, then ``./data`` (torchvision's ``cifar-10-batches-py`` download). With none of them those tests are
skipped with the reason; with ``ZOO_DATA_DIR`` set to a folder that holds no CIFAR-10 they fail (CI sets it,
so CI never skips them silently). Tests never download, and never write into the real user cache
directory."""

from __future__ import annotations

import io
import os
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def slow_except(values, keep) -> list:
    """``values`` as pytest params for a check repeated per model: those in ``keep`` run in the default suite
    (its small form), the others under ``-m slow``."""
    return [pytest.param(value, marks=() if value in keep else pytest.mark.slow) for value in values]


def write_image_tree(root: Path, size: int, counts=(("train", 8), ("test", 2)), classes: int = 10) -> Path:
    """train/ and test/ ImageFolder trees of random ``size`` x ``size`` PNGs (seeded), ``classes`` classes."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in counts:
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def train_in_process(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python train.py *argv`` run as ``zoo.train.cli.main(argv)`` in this process, its stdout and stderr
    captured: a ``CompletedProcess`` as ``subprocess.run(..., capture_output=True, text=True)`` gives, without
    the ~10 s a new process spends importing torch, timm and Lightning. For tests of what a run does; what
    only a process shows (signals from outside, exit by a signal, the first screen, imports) keeps a subprocess."""
    from zoo.train.cli import main

    out, err, before = io.StringIO(), io.StringIO(), Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main([str(a) for a in argv])
            except SystemExit as stop:  # argparse's errors
                code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(["train.py", *argv], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def run_train():
    """``train_in_process``, for tests and module fixtures."""
    return train_in_process


@pytest.fixture(scope="session")
def image_tree_writer():
    """``write_image_tree``, for module fixtures that build their own tree."""
    return write_image_tree
DATA_ENV = "ZOO_DATA_DIR"
CANDIDATES = (REPO.parent / "shared" / "data" / "cifar10", REPO / "data")


def holds_cifar10(folder: Path) -> bool:
    """An ImageFolder tree (train/ and test/ class folders) or torchvision's cifar-10-batches-py download."""
    return ((folder / "train").is_dir() and (folder / "test").is_dir()) or (
        folder / "cifar-10-batches-py" / "data_batch_1").is_file()


def find_cifar10() -> Path | None:
    """The CIFAR-10 folder the tests use, or None; ``ZOO_DATA_DIR`` that holds none -> pytest.fail."""
    if os.environ.get(DATA_ENV):
        folder = Path(os.environ[DATA_ENV]).expanduser().resolve()
        if not holds_cifar10(folder):
            pytest.fail(f"{DATA_ENV}={folder} holds no CIFAR-10 (expected train/<class>/ and test/<class>/ "
                        "image folders, or cifar-10-batches-py)")
        return folder
    return next((folder for folder in CANDIDATES if holds_cifar10(folder)), None)


def pytest_configure(config):
    """Under pytest-xdist (``-n N``) each worker takes its share of the cores for torch's intra-op threads, and
    the processes its tests start inherit it: N workers of every core's threads each would oversubscribe the
    machine (on 2 cores, ``-n 2`` with 2 threads a worker ran the suite 1.6x slower than one process)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.fixture(autouse=True, scope="session")
def _user_cache(tmp_path_factory):
    """Point the user cache directory (``$XDG_CACHE_HOME``, where data caches go by default) into the
    session's temporary folder, so tests never write into the real ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def require_cifar10() -> Path:
    """``find_cifar10()``, or pytest.skip with the reason and the places looked in when there is none."""
    folder = find_cifar10()
    if folder is None:
        pytest.skip(f"no CIFAR-10 found: set {DATA_ENV}, or put it at {CANDIDATES[0]} or {CANDIDATES[1]} "
                    "(torchvision's cifar-10-batches-py); tests never download")
    return folder


@pytest.fixture(scope="session")
def cifar_dir() -> Path:
    """The real CIFAR-10 folder (read-only; never write into it)."""
    return require_cifar10()


@pytest.fixture(scope="session")
def tiny_run(cifar_dir, tmp_path_factory):
    """A vit_nano run trained for 2 steps on 128 real images, tested on 32 (Lightning's test loop)."""
    root = tmp_path_factory.mktemp("runs")
    done = train_in_process(["--model", "vit_nano", "--data-dir", cifar_dir, "--epochs", "1",
                             "--max-train-images", "128", "--max-test-images", "32", "--limit-train-batches", "2",
                             "--limit-val-batches", "1", "--batch-size", "32", "--set", "val_size=32", "--out", root,
                             "--cache-dir", root / "cache"])
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = (root / "vit_nano").iterdir()
    return run


@pytest.fixture
def spread_test_images(cifar_dir):
    """``spread(class_names, count)``: ``count`` real test images (uint8, N x 3 x H x W) evenly spaced through
    test/<class>/<file> (classes in ``class_names`` order, files sorted) and their labels, decoded by
    torchvision.io: independent of the zoo's data pipeline."""
    from torchvision.io import ImageReadMode, decode_image

    def spread(class_names, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        files = [(label, cifar_dir / "test" / c / f) for label, c in enumerate(class_names)
                 for f in sorted(os.listdir(cifar_dir / "test" / c))]
        index = torch.linspace(0, len(files) - 1, count).round().long().tolist()
        images = torch.stack([decode_image(str(files[i][1]), mode=ImageReadMode.RGB) for i in index])
        return images, torch.tensor([files[i][0] for i in index])

    return spread
