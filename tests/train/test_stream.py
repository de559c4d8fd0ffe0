"""Data that does not fit on the device: the budget decision against its formula, and the streamed path (the
memory-mapped cache read by DataLoader workers) against the resident path as the reference, on real CIFAR-10
images: the same batches epoch by epoch (alternating flip included), and the same training losses step by step
with the same seed under the same random augmentation (crop, flip, RandAugment, mixup / cutmix, cutout)."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch

import zoo.data.stream as stream
from zoo.data import ImageData
from zoo.train import loop
from zoo.train.recipe import Recipe

AUGMENT = {"crop_padding": 4, "hflip": True, "alternating_flip": False, "randaugment": {"num_ops": 2, "magnitude": 9},
           "mixup_alpha": 0.2, "cutmix_alpha": 1.0, "cutout": 8}


def data(cifar_dir, tmp_path, budget: float | None, **kwargs) -> ImageData:
    options = dict(max_train_images=120, max_test_images=30, val_size=20, batch_size=16, eval_batch_size=16,
                   seed=3, cache_dir=tmp_path / "cache", stream_workers=2)
    return ImageData(cifar_dir, memory_budget=budget, **{**options, **kwargs})


def test_the_budget_is_given_in_gib_or_half_the_measured_free_memory(monkeypatch):
    cpu = torch.device("cpu")
    assert not stream.stream_needed(2**30, cpu, 1.0) and stream.stream_needed(2**30 + 1, cpu, 1.0)
    assert stream.stream_needed(1, cpu, 0.0)
    monkeypatch.setattr(stream, "free_memory", lambda device: 1000)
    assert not stream.stream_needed(500, cpu, None) and stream.stream_needed(501, cpu, None)
    monkeypatch.setattr(stream, "free_memory", lambda device: None)   # not measurable: resident
    assert not stream.stream_needed(10**15, cpu, None)
    with pytest.raises(ValueError, match="data_memory_budget must be a non-negative number, got -1"):
        Recipe(data_memory_budget=-1)
    with pytest.raises(ValueError, match="memory_budget must be None or a number of GiB >= 0, got 'x'"):
        ImageData(memory_budget="x")


def test_streamed_batches_are_the_resident_batches(cifar_dir, tmp_path):
    """Two epochs of training batches (the alternating flip mirrors the other half in epoch 1), validation and
    test, from 2 workers reading the memory map, equal the resident module's; pickling the dataset (what a
    spawned worker receives) copies no images."""
    modules = {}
    for budget in (None, 0.0):
        dm = data(cifar_dir, tmp_path, budget, augment={"alternating_flip": True})
        dm.prepare_data()
        dm.setup("fit")
        dm.setup("test")
        modules[budget] = dm
    resident, streamed = modules[None], modules[0.0]
    assert resident.streamed is False and streamed.streamed is True
    assert type(streamed.train_dataset).__name__ == "MappedBatches"
    images_bytes = streamed.train_dataset.images.nbytes
    assert len(pickle.dumps(streamed.train_dataset)) < images_bytes / 10
    clone = pickle.loads(pickle.dumps(streamed.train_dataset))
    assert all(map(torch.equal, clone.__getitems__([5, 0, 7]), resident.train_dataset.__getitems__([5, 0, 7])))
    loaders = {dm: dm.train_dataloader() for dm in (resident, streamed)}
    assert loaders[streamed].num_workers == 2 and loaders[resident].num_workers == 0
    for epoch in (0, 1):
        resident.epoch = streamed.epoch = epoch
        batches = {dm: list(loader) for dm, loader in loaders.items()}
        assert len(batches[resident]) == 100 // 16
        for (x, y), (xs, ys) in zip(batches[resident], batches[streamed], strict=True):
            assert torch.equal(x, xs) and torch.equal(y, ys)
    for split in ("val_dataloader", "test_dataloader"):
        pairs = zip(getattr(resident, split)(), getattr(streamed, split)(), strict=True)
        assert all(torch.equal(x, xs) and torch.equal(y, ys) for (x, y), (xs, ys) in pairs)


def test_the_test_setup_keeps_the_fits_choice(cifar_dir, tmp_path, monkeypatch):
    """The fit's setup on a device decides; the test's on that device (after training filled it) keeps it, and so
    does a test-only setup later; the ranks' ``agree`` makes the decision one for all."""
    from zoo.data import images

    dm = data(cifar_dir, tmp_path, None)
    dm.prepare_data()
    full = iter([False, True])  # what the budget says at each decision
    monkeypatch.setattr(images, "stream_needed", lambda *args: next(full))
    dm.setup("fit", device="cpu")
    dm.setup("test", device="cpu")  # the budget would now say True: kept False
    assert dm.streamed is False and type(dm.test_dataset).__name__ == "_TensorBatches"
    other = data(cifar_dir, tmp_path, None)
    monkeypatch.setattr(images, "stream_needed", lambda *args: False)
    other.setup("fit", device="cpu", agree=lambda mine: True)  # another rank's budget says stream: all do
    assert other.streamed is True


class Losses:
    def __init__(self):
        self.losses, self.streamed = [], None

    def on_train_start(self, run):
        self.streamed = run.data.streamed

    def on_train_batch_end(self, run):
        self.losses.append(run.totals.sums[0].clone())  # the loss times the images, summed so far


def test_streamed_training_takes_the_resident_steps(run_train, cifar_dir, tmp_path, monkeypatch):
    """The budget forced to 0 GiB: the first training steps' losses equal the resident path's, seed for seed, with
    RandAugment, mixup / cutmix and cutout drawn after the batch reaches the device."""
    seen = {}
    sets = [f"augment.{key}={value}" for key, value in AUGMENT.items() if key != "randaugment"]
    sets += ["augment.randaugment={num_ops: 2, magnitude: 9}"]
    for budget in ("null", "0"):
        losses = Losses()
        monkeypatch.setattr(loop, "fit", functools.partial(loop.fit, callbacks=[losses]))
        done = run_train(["--model", "vit_nano", "--data-dir", cifar_dir, "--max-train-images", "120",
                          "--max-test-images", "16", "--set", "val_size=20", "--batch-size", "16", "--seed", "3",
                          "--epochs", "1", "--limit-train-batches", "4", "--limit-val-batches", "0",
                          "--limit-test-batches", "1", "--precision", "32", "--set", "model_args.embed_dim=32",
                          "--set", "model_args.depth=1", "--set", "model_args.num_heads=2", "--set",
                          f"data_memory_budget={budget}", "--cache-dir", tmp_path / "cache", "--out",
                          tmp_path / budget, *[arg for item in sets for arg in ("--set", item)]])
        assert done.returncode == 0, done.stderr[-2000:]
        assert losses.streamed is (budget == "0")
        seen[budget] = torch.stack(losses.losses)
    assert len(seen["null"]) == 4 and torch.isfinite(seen["null"]).all()
    assert torch.equal(seen["null"], seen["0"])


def test_a_streamed_run_keeps_its_images_when_another_process_rebuilds_the_cache(cifar_dir, tmp_path):
    """Another train.py rebuilding the shared cache file (a new file renamed over it) mid-run: the streamed
    datasets, and a worker's copy of them (a spawned worker maps the file itself), still read the images the
    module loaded, which match its labels."""
    import pickle

    from zoo.atomic import atomic_write

    dm = data(cifar_dir, tmp_path, 0.0)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.streamed
    (cache_file,) = (tmp_path / "cache").glob("*.pt")
    loaded = torch.load(cache_file, weights_only=True)
    expected = loaded["train_images"][dm.train_dataset.rows[:8]].clone()
    rebuilt = {**loaded, "train_images": torch.zeros_like(loaded["train_images"])}
    atomic_write(cache_file, lambda f: torch.save(rebuilt, f))  # what another process's rebuild does
    worker = pickle.loads(pickle.dumps(dm.train_dataset))
    torch.testing.assert_close(worker[:8][0], expected, rtol=0, atol=0)
    torch.testing.assert_close(dm.train_dataset[:8][0], expected, rtol=0, atol=0)
