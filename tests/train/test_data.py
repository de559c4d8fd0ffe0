"""Tests of zoo.data: layouts, split, statistics, cache placement and reliability, batched augmentation.

Synthetic data is written into tmp_path (PNG ImageFolder trees with PIL, CIFAR-10 python batches in
torchvision's pickle format); the real CIFAR-10 tree is only read through small subsets."""

from __future__ import annotations

import os
import pickle
import urllib.error
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from PIL import Image

import zoo.data.cache
import zoo.data.decode
from zoo.bench.dispatch import OpRecorder
from zoo.data import DataError, ImageData, cutout, random_crop, random_hflip
from zoo.data.augment import AlternatingFlip

CLASSES = ["cat", "dog", "frog"]
CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def write_imagefolder(root: Path, per_class: int = 4, size: tuple[int, int] = (32, 32), seed: int = 0):
    """PNG images under root/{train,test}/<class>/; returns {split: (uint8 (N, H, W, 3) arrays, labels)} in
    the sorted order of class then file name."""
    rng = np.random.default_rng(seed)
    out = {}
    for split in ("train", "test"):
        arrays, labels = [], []
        for label, name in enumerate(CLASSES):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                array = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
                Image.fromarray(array).save(root / split / name / f"{i:04d}.png")
                arrays.append(array)
                labels.append(label)
        out[split] = (np.stack(arrays), np.array(labels))
    return out


def write_cifar_batches(root: Path, per_batch: int = 40, n_test: int = 30, seed: int = 0) -> dict:
    """torchvision's cifar-10-batches-py format (rows of 3072 bytes, channel-major; str keys as latin1 reads
    them). Image i of the train split has i encoded in its first two bytes, so tests can identify it."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    out = {}
    for split, names in (("train", [f"data_batch_{i}" for i in range(1, 6)]), ("test", ["test_batch"])):
        n = per_batch if split == "train" else n_test
        datas, labels = [], []
        for b, name in enumerate(names):
            data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
            ids = np.arange(b * n, (b + 1) * n)
            data[:, 0], data[:, 1] = ids % 256, ids // 256
            batch_labels = rng.integers(0, 10, n).tolist()
            with open(folder / name, "wb") as f:
                pickle.dump({"batch_label": name, "labels": batch_labels, "data": data,
                             "filenames": [f"{i}.png" for i in ids]}, f)
            datas.append(data)
            labels += batch_labels
        out[split] = (np.concatenate(datas).reshape(-1, 3, 32, 32), np.array(labels))
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": CIFAR_NAMES, "num_cases_per_batch": per_batch, "num_vis": 3072}, f)
    return out


@pytest.fixture
def no_download(monkeypatch):
    """Any attempt to download fails the test."""
    def refuse(*args, **kwargs):
        pytest.fail("a download was attempted")
    monkeypatch.setattr(torchvision.datasets.utils, "download_url", refuse)
    monkeypatch.setattr(torchvision.datasets.utils, "download_and_extract_archive", refuse)
    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive", refuse)
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", refuse)


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts zoo.data's image decodes."""
    calls = []
    real = zoo.data.decode.decode_image

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(zoo.data.decode, "decode_image", counting)
    return calls


def make(data_dir, tmp_path, **kwargs) -> ImageData:
    kwargs = {"cache_dir": tmp_path / "cache", "val_size": 2, "batch_size": 4, **kwargs}
    return ImageData(data_dir, **kwargs)


def all_train(dm: ImageData) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.cat([dm.train_dataset.images, dm.val_dataset.images])
    labels = torch.cat([dm.train_dataset.labels, dm.val_dataset.labels])
    return images, labels


def sort_rows(images: torch.Tensor) -> torch.Tensor:
    """Images as a set: rows of flattened pixels in lexicographic order."""
    rows = images.flatten(1).numpy()
    return torch.from_numpy(rows[np.lexsort(rows.T[::-1])])


# ---------------------------------------------------------------- layouts


def test_imagefolder_layout_reads_every_image_exactly(tmp_path, no_download):
    written = write_imagefolder(tmp_path / "data")
    dm = make(tmp_path / "data", tmp_path)
    dm.prepare_data()
    dm.setup()
    assert dm.class_names == CLASSES and dm.num_classes == 3 and dm.img_size == 32
    images, labels = all_train(dm)
    expected = torch.from_numpy(written["train"][0]).permute(0, 3, 1, 2)
    assert images.dtype == torch.uint8 and labels.dtype == torch.int64
    assert torch.equal(sort_rows(images), sort_rows(expected))
    test_images = torch.from_numpy(written["test"][0]).permute(0, 3, 1, 2)
    assert torch.equal(dm.test_dataset.images, test_images)
    assert dm.test_dataset.labels.tolist() == written["test"][1].tolist()


@pytest.mark.parametrize("point_at_batches", [False, True])
def test_cifar_batches_layout(tmp_path, no_download, point_at_batches):
    written = write_cifar_batches(tmp_path / "data")
    data_dir = tmp_path / "data" / ("cifar-10-batches-py" if point_at_batches else "")
    dm = make(data_dir, tmp_path, val_size=20)
    dm.setup()
    assert dm.class_names == CIFAR_NAMES and dm.num_classes == 10
    images, labels = all_train(dm)
    ids = images[:, 0, 0, 0].long() + 256 * images[:, 0, 0, 1].long()
    assert sorted(ids.tolist()) == list(range(200))
    assert torch.equal(images, torch.from_numpy(written["train"][0])[ids])
    assert torch.equal(labels, torch.from_numpy(written["train"][1])[ids])
    assert torch.equal(dm.test_dataset.images, torch.from_numpy(written["test"][0]))


@pytest.mark.parametrize("case, problem", [
    ("missing", "does not exist"), ("empty", "is empty"), ("wrong", r"holds no dataset \(found images, readme.txt\)"),
    ("no_classes", "train has no class folders"), ("no_images", "train holds no image files"),
])
def test_bad_layouts_raise_data_error(tmp_path, no_download, case, problem):
    root = tmp_path / "data"
    if case != "missing":
        root.mkdir()
    if case == "wrong":
        (root / "images").mkdir()
        (root / "readme.txt").write_text("hello")
    if case in ("no_classes", "no_images"):
        (root / "train").mkdir()
        (root / "test").mkdir()
    if case == "no_images":
        (root / "train" / "cat").mkdir()
    dm = make(root, tmp_path)
    with pytest.raises(DataError, match=problem) as info:
        dm.prepare_data()
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    assert "cifar-10-batches-py" in message and "train/<class>" in message and "--download" in message


def test_unreadable_cifar_batch_is_a_data_error(tmp_path, no_download):
    write_cifar_batches(tmp_path / "data")
    (tmp_path / "data" / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(DataError, match="data_batch_3"):
        make(tmp_path / "data", tmp_path).prepare_data()


def test_offline_download_failure_is_one_clear_data_error(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(torchvision.datasets.utils, "download_and_extract_archive", offline)
    monkeypatch.chdir(tmp_path)
    expected = "could not download CIFAR-10 into data .*cifar-10-batches-py"
    with pytest.raises(DataError, match=expected) as info:
        ImageData(cache_dir=tmp_path / "cache").prepare_data()  # data_dir None: ./data, downloads
    assert "\n" not in str(info.value)


def test_explicit_download_fetches_into_the_folder(tmp_path, monkeypatch):
    fetched = []

    def fake_download(url, root, **kwargs):
        fetched.append(root)
        write_cifar_batches(Path(root))
    monkeypatch.setattr(torchvision.datasets.utils, "download_and_extract_archive", fake_download)
    dm = make(tmp_path / "data", tmp_path, download=True, val_size=20)
    dm.setup()
    assert fetched == [str(tmp_path / "data")] and dm.num_classes == 10


def test_bad_files_are_skipped_with_a_warning_naming_them(tmp_path, decode_calls):
    written = write_imagefolder(tmp_path / "data")
    notes = tmp_path / "data" / "train" / "dog" / "notes.txt"
    notes.write_text("not an image")
    broken = tmp_path / "data" / "train" / "cat" / "9999.png"
    broken.write_bytes((tmp_path / "data" / "train" / "cat" / "0000.png").read_bytes()[:40])
    dm = make(tmp_path / "data", tmp_path)
    with pytest.warns(UserWarning) as record:
        dm.setup()
    messages = " ".join(str(w.message) for w in record)
    assert str(notes) in messages and str(broken) in messages
    images, labels = all_train(dm)
    assert len(images) == len(written["train"][0])
    assert torch.equal(labels.sort().values, torch.from_numpy(written["train"][1]).sort().values)


# ---------------------------------------------------------------- split, statistics, resize


def test_split_sizes_seeded_and_disjoint(tmp_path, no_download):
    write_cifar_batches(tmp_path / "data")
    modules = [make(tmp_path / "data", tmp_path, val_size=50, seed=s, batch_size=32) for s in (0, 0, 1)]
    for dm in modules:
        dm.setup("fit")
    ids = [[(d.images[:, 0, 0, 0].long() + 256 * d.images[:, 0, 0, 1].long()).tolist()
            for d in (dm.train_dataset, dm.val_dataset)] for dm in modules]
    train0, val0 = ids[0]
    assert len(val0) == 50 and len(train0) == 150 and not set(train0) & set(val0)
    assert ids[0] == ids[1] and set(ids[2][1]) != set(val0)

    def epoch_order(dm):
        return [labels.tolist() for _, labels in dm.train_dataloader()]
    first, second = epoch_order(modules[0]), epoch_order(modules[0])
    assert first == epoch_order(modules[1]) and second == epoch_order(modules[1])  # same seed, same orders
    assert first != second  # a new order each epoch
    assert len(first) == 150 // 32 and all(len(b) == 32 for b in first)  # the incomplete batch dropped
    assert [len(labels) for _, labels in modules[0].val_dataloader()] == [32, 18]


def test_val_size_must_leave_training_images(tmp_path):
    write_imagefolder(tmp_path / "data", per_class=2)
    with pytest.raises(ValueError, match="val_size"):
        make(tmp_path / "data", tmp_path, val_size=6).setup("fit")


def test_mean_std_equal_numpy_over_training_images(tmp_path):
    written = write_imagefolder(tmp_path / "data", per_class=5)
    dm = make(tmp_path / "data", tmp_path)
    dm.setup()
    pixels = written["train"][0].astype(np.float64) / 255  # (N, H, W, 3)
    np.testing.assert_allclose(dm.mean, pixels.mean(axis=(0, 1, 2)), rtol=0, atol=1e-9)
    np.testing.assert_allclose(dm.std, pixels.std(axis=(0, 1, 2)), rtol=0, atol=1e-9)
    reloaded = make(tmp_path / "data", tmp_path)
    reloaded.setup()
    assert reloaded.mean == dm.mean and reloaded.std == dm.std  # kept with the cache


def test_other_sizes_are_resized_like_pil(tmp_path):
    written = write_imagefolder(tmp_path / "data", per_class=2, size=(48, 48))
    dm = make(tmp_path / "data", tmp_path, img_size=32)
    dm.setup("test")
    expected = np.stack([np.asarray(Image.fromarray(a).resize((32, 32), Image.BILINEAR))
                         for a in written["test"][0]])
    got = dm.test_dataset.images.permute(0, 2, 3, 1).numpy().astype(int)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 2 and np.abs(got - expected).mean() < 0.5


def test_non_square_images_are_resized_and_centre_cropped(tmp_path):
    write_imagefolder(tmp_path / "data", per_class=1, size=(40, 64))
    dm = make(tmp_path / "data", tmp_path, img_size=16, val_size=1)
    dm.setup()
    assert dm.train_dataset.images.shape[1:] == (3, 16, 16)


# ---------------------------------------------------------------- cache


def cache_files(tmp_path) -> list[Path]:
    return sorted((tmp_path / "cache").iterdir())


def test_second_setup_reads_the_cache_without_decoding(tmp_path, decode_calls):
    write_imagefolder(tmp_path / "data")
    first = make(tmp_path / "data", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a clean build warns about nothing
        first.prepare_data()
        first.setup()
    assert len(decode_calls) == 24
    [cache] = cache_files(tmp_path)
    second = make(tmp_path / "data", tmp_path)
    second.prepare_data()
    second.setup()
    assert len(decode_calls) == 24
    assert torch.equal(second.test_dataset.images, first.test_dataset.images)
    assert cache_files(tmp_path) == [cache]


def test_a_module_validates_the_files_once_and_a_new_module_again(tmp_path, monkeypatch):
    """Lightning calls prepare_data before fit and again before test: the files are fingerprinted (a stat of each:
    half a second for 60,000) once per module; a new module (the next run) fingerprints them again."""
    write_imagefolder(tmp_path / "data")
    fingerprinted = []
    real = zoo.data.cache.data_fingerprint
    monkeypatch.setattr(zoo.data.cache, "data_fingerprint",
                        lambda *args: fingerprinted.append(args) or real(*args))
    dm = make(tmp_path / "data", tmp_path)
    dm.prepare_data()
    dm.setup("fit")
    dm.prepare_data()  # as Lightning's fit and test do
    dm.setup("test")
    assert len(fingerprinted) == 1
    make(tmp_path / "data", tmp_path).prepare_data()
    assert len(fingerprinted) == 2


def listing(root: Path) -> list[tuple[str, int]]:
    """Every path under ``root`` (relative) with its size: what a build must leave unchanged."""
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


def test_cache_never_goes_into_a_writable_data_folder(tmp_path, monkeypatch):
    write_imagefolder(tmp_path / "data", per_class=2)
    before = listing(tmp_path / "data")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    dm = ImageData(tmp_path / "data", val_size=1)
    dm.prepare_data()
    dm.setup()
    assert listing(tmp_path / "data") == before
    [folder] = (tmp_path / "xdg" / "zoo").iterdir()
    assert [p.suffix for p in folder.iterdir()] == [".pt"]
    assert dm.cache_path(tmp_path / "data").parent == folder


def test_cache_goes_to_home_cache_without_xdg_and_to_cache_dir_when_given(tmp_path, monkeypatch):
    write_imagefolder(tmp_path / "data", per_class=2)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for xdg in (None, "", "relative/path"):  # unset, empty or relative: the XDG rule falls back to ~/.cache
        if xdg is None:
            monkeypatch.delenv("XDG_CACHE_HOME")
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        path = ImageData(tmp_path / "data", val_size=1).cache_path(tmp_path / "data")
        assert path.parent.parent == tmp_path / "home" / ".cache" / "zoo"
    explicit = ImageData(tmp_path / "data", val_size=1, cache_dir=tmp_path / "mine")
    assert explicit.cache_path(tmp_path / "data").parent == tmp_path / "mine"


def test_cache_goes_to_user_cache_when_data_folder_is_read_only(tmp_path, monkeypatch):
    write_imagefolder(tmp_path / "data", per_class=2)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    os.chmod(tmp_path / "data", 0o555)
    try:
        dm = ImageData(tmp_path / "data", val_size=1)
        dm.setup()
        assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["test", "train"]
        [folder] = (tmp_path / "home" / ".cache" / "zoo").iterdir()
        assert [p.suffix for p in folder.iterdir()] == [".pt"]
    finally:
        os.chmod(tmp_path / "data", 0o755)


@pytest.mark.parametrize("damage", ["truncate", "tamper"])
def test_corrupt_cache_is_rebuilt_with_a_warning(tmp_path, decode_calls, damage):
    write_imagefolder(tmp_path / "data")
    good = make(tmp_path / "data", tmp_path)
    good.setup()
    [cache] = cache_files(tmp_path)
    if damage == "truncate":
        cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    else:  # a well-formed file whose tensors no longer match the stored checksum
        content = torch.load(cache, weights_only=True)
        content["train_images"][0, 0, 0, 0] ^= 1
        torch.save(content, cache)
    dm = make(tmp_path / "data", tmp_path)
    with pytest.warns(UserWarning, match="corrupt"):
        dm.setup()
    assert len(decode_calls) == 48
    assert torch.equal(dm.train_dataset.images, good.train_dataset.images)
    make(tmp_path / "data", tmp_path).setup()  # the rebuilt cache is whole again
    assert len(decode_calls) == 48


def test_crash_while_writing_leaves_the_old_cache_intact(tmp_path, monkeypatch):
    written = write_imagefolder(tmp_path / "data")
    make(tmp_path / "data", tmp_path).setup()
    [cache] = cache_files(tmp_path)
    good_bytes = cache.read_bytes()
    Image.fromarray(written["test"][0][0]).save(tmp_path / "data" / "test" / "cat" / "0100.png")  # new data

    def crash_mid_write(obj, f):
        f.write(good_bytes[:100])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", crash_mid_write)
    dm = make(tmp_path / "data", tmp_path)
    with pytest.warns(UserWarning, match="could not write the data cache"), \
            pytest.warns(UserWarning, match="data files changed"):
        dm.setup()
    assert cache_files(tmp_path) == [cache] and cache.read_bytes() == good_bytes  # no temp file left behind
    assert len(dm.test_dataset.labels) == 13  # the run goes on with the new data


def test_explicit_folder_never_downloads(tmp_path, no_download):
    write_cifar_batches(tmp_path / "data")
    make(tmp_path / "data", tmp_path, val_size=20).setup()
    with pytest.raises(DataError, match="nothing does not exist"):
        make(tmp_path / "nothing", tmp_path).setup()


# ---------------------------------------------------------------- augmentation and transforms


def test_random_crop_equals_pad_and_slice():
    images = torch.randint(0, 256, (6, 3, 8, 10), dtype=torch.uint8)
    offsets = torch.tensor([[0, 0], [4, 4], [1, 3], [3, 0], [2, 2], [0, 4]])
    got = random_crop(images, 2, offsets)
    padded = F.pad(images, (2, 2, 2, 2))
    for i, (top, left) in enumerate(offsets.tolist()):
        assert torch.equal(got[i], padded[i, :, top:top + 8, left:left + 10])
    drawn = random_crop(images, 2)
    assert drawn.shape == images.shape and drawn.dtype == torch.uint8


def test_random_hflip_equals_torch_flip():
    images = torch.randint(0, 256, (4, 3, 5, 7), dtype=torch.uint8)
    flip = torch.tensor([True, False, True, False])
    got = random_hflip(images, flip)
    for i in range(4):
        assert torch.equal(got[i], torch.flip(images[i], dims=[-1]) if flip[i] else images[i])


def test_cutout_zeroes_one_square_per_image_like_slicing():
    images = torch.rand(5, 3, 8, 10) + 1.0  # no zeros of its own
    corners = torch.tensor([[0, 0], [5, 7], [2, 3], [0, 7], [5, 0]])  # (top, left), the square inside 8 x 10
    got = cutout(images, 3, corners)
    for i, (top, left) in enumerate(corners.tolist()):
        expected = images[i].clone()
        expected[:, top:top + 3, left:left + 3] = 0.0
        assert torch.equal(got[i], expected)
    drawn = cutout(images, 4)
    assert ((drawn == 0).sum(dim=(1, 2, 3)) == 3 * 4 * 4).all()  # each image loses exactly its square
    assert cutout(images, 0) is images
    with pytest.raises(ValueError, match="augment cutout 9 is larger than the 8x10 images; use at most 8"):
        cutout(images, 9)


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_augments_its_slice_of_a_global_batch_as_one_process_does(world):
    """Every rank's generators agree (one seed): each draws for the whole global batch and takes its slice, so an
    image is augmented as in one process whatever the world size, and two ranks never augment alike."""
    from zoo.data.augment import BatchAugment

    augment = BatchAugment({"crop_padding": 4, "randaugment": True, "cutout": 8}, num_classes=10)
    images = torch.randint(0, 256, (world * 4, 3, 32, 32), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    labels, normalize = torch.arange(world * 4) % 10, lambda x: x.float() / 255

    def run(rows: slice, shard=(0, 1)):
        torch.manual_seed(1)  # each rank's generator where rank 0's is
        return augment(images[rows], labels[rows], normalize, shard)[0]

    whole = run(slice(None))  # one process, the whole global batch
    for rank in range(world):
        mine = slice(4 * rank, 4 * (rank + 1))
        torch.testing.assert_close(run(mine, (rank, world)), whole[mine], rtol=0, atol=0)
    assert not torch.equal(run(slice(0, 4), (0, world)), run(slice(0, 4), (1, world)))


def test_the_data_module_augments_as_its_rank_of_the_world(tmp_path):
    write_imagefolder(tmp_path / "data", per_class=6)
    dm = make(tmp_path / "data", tmp_path, batch_size=8, val_size=4)
    dm.setup("fit")
    images, labels = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8), torch.arange(4)
    dm._ranks = lambda: (3, 2)  # (world size, rank), as a trainer of three processes gives them to rank 2
    torch.manual_seed(0)
    got = dm.augment(images, labels)[0]
    torch.manual_seed(0)
    torch.testing.assert_close(got, dm._augment(images, labels, dm.normalize, shard=(2, 3))[0], rtol=0, atol=0)


@pytest.fixture
def small_dm(tmp_path):
    write_imagefolder(tmp_path / "data", per_class=6)
    return make(tmp_path / "data", tmp_path, batch_size=8, val_size=4)


def test_normalize_and_denormalize_against_the_formula(small_dm):
    small_dm.setup()
    images = small_dm.test_dataset.images[:5]
    mean = torch.tensor(small_dm.mean).view(1, 3, 1, 1)
    std = torch.tensor(small_dm.std).view(1, 3, 1, 1)
    expected = (images.double() / 255 - mean.double()) / std.double()
    got = small_dm.normalize(images)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(small_dm.denormalize(got), images.float() / 255, rtol=0, atol=1e-6)


def test_evaluation_batches_are_normalised_and_training_batches_augmented_anew(small_dm):
    small_dm.setup()
    images, labels = next(iter(small_dm.val_dataloader()))
    torch.testing.assert_close(small_dm.normalize(images), (images.float() / 255 - torch.tensor(small_dm.mean).view(
        1, 3, 1, 1)) / torch.tensor(small_dm.std).view(1, 3, 1, 1))
    outs = [small_dm.augment(images, labels) for _ in range(3)]
    assert all(o.shape == images.shape and o.dtype == torch.float32 and same is labels for o, same in outs)
    assert not torch.equal(outs[0][0], outs[1][0]) or not torch.equal(outs[1][0], outs[2][0])  # random crops / flips


@pytest.mark.parametrize("augment", [
    {"mixup_alpha": 0.8},
    {"cutmix_alpha": 1.0},
    {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "randaugment": {"num_ops": 2, "magnitude": 9}},
])
def test_mixup_cutmix_labels_are_probabilities(tmp_path, augment):
    write_imagefolder(tmp_path / "data", per_class=6)
    dm = make(tmp_path / "data", tmp_path, batch_size=8, val_size=4, augment=augment)
    dm.setup("fit")
    images, labels = next(iter(dm.train_dataloader()))
    out, soft = dm.augment(images, labels)
    assert out.shape == images.shape and out.dtype == torch.float32
    assert soft.shape == (8, 3) and soft.dtype == torch.float32 and (soft >= 0).all()
    torch.testing.assert_close(soft.sum(1), torch.ones(8))
    assert set(soft.nonzero()[:, 1].tolist()) <= set(labels.tolist())  # mixes of the batch's own labels
    assert (soft < 1).any()  # something was mixed


def test_default_augment_keeps_int_labels(small_dm):
    small_dm.setup("fit")
    images, labels = next(iter(small_dm.train_dataloader()))
    out, same = small_dm.augment(images, labels)
    assert same.dtype == torch.int64 and torch.equal(same, labels)


@pytest.mark.parametrize("kwargs, message", [
    ({"augment": {"blur": 1}}, r"unknown augment keys \['blur'\]"),
    ({"augment": {"randaugment": {"ops": 2}}}, r"unknown randaugment keys \['ops'\]"),
    ({"augment": {"crop_padding": -1}}, "crop_padding must be an int >= 0, got -1"),
    ({"augment": {"cutout": 1.5}}, r"cutout must be an int >= 0 \(the square's side in pixels\), got 1.5"),
    ({"img_size": 0}, "img_size must be an int >= 1, got 0"),
    ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
    ({"device_cache": "nonsense"}, "device_cache must be 'auto' or a device, got 'nonsense'"),
])
def test_bad_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ImageData("unused", **kwargs)


def test_loaders_before_setup_raise(tmp_path):
    with pytest.raises(ValueError, match="setup"):
        make(tmp_path, tmp_path).train_dataloader()


def test_augment_before_setup_raises(tmp_path):
    images, labels = torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"call setup\(\) first"):
        make(tmp_path, tmp_path).augment(images, labels)


def test_ranks_split_each_global_batch_and_evaluate_every_image_once(tmp_path):
    """Under 2 processes each rank's loader yields its half of every single-process batch (batch_size is the
    global batch), and the validation shards cover the validation split once, unpadded."""
    write_cifar_batches(tmp_path / "data")

    def loaders(world: int, rank: int):
        dm = make(tmp_path / "data", tmp_path, val_size=21, batch_size=16)
        dm._ranks = lambda: (world, rank)  # (world size, rank), as a process group of `world` gives them to `rank`
        dm.setup("fit")
        def ids(loader):  # image i of the split carries i in its first two bytes
            return [(x[:, 0, 0, 0].long() + 256 * x[:, 0, 0, 1].long()).tolist() for x, _ in loader]
        return ids(dm.train_dataloader()), ids(dm.val_dataloader()), dm

    single, single_val, dm = loaders(1, 0)
    ranks = [loaders(2, rank) for rank in range(2)]
    assert len(single) == (200 - 21) // 16 and all(len(r[0]) == len(single) for r in ranks)
    for step, batch in enumerate(single):
        assert [len(r[0][step]) for r in ranks] == [8, 8] and ranks[0][0][step] + ranks[1][0][step] == batch
    assert ranks[0][1] != ranks[1][1] and sum(ranks[0][1] + ranks[1][1], []) == sum(single_val, [])
    assert len(sum(single_val, [])) == 21 == len(dm.val_dataset)


# ---------------------------------------------------------------- real data


def test_real_cifar10_subset(cifar_dir, tmp_path, no_download, decode_calls):
    dm = ImageData(cifar_dir, cache_dir=tmp_path / "cache", max_train_images=300, max_test_images=100,
                         val_size=50, batch_size=64)
    dm.prepare_data()
    dm.setup()
    assert len(decode_calls) == 400  # only the chosen files are decoded
    assert dm.class_names == CIFAR_NAMES
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (250, 50, 100)
    assert all(0.35 < m < 0.6 for m in dm.mean) and all(0.18 < s < 0.32 for s in dm.std)
    assert len(set(dm.test_dataset.labels.tolist())) == 10
    first = Path(decode_calls[0])  # train/airplane/NNNN.jpg: decoded as PIL decodes it (both libjpeg)
    assert first.parent.name == "airplane"
    pil = torch.from_numpy(np.array(Image.open(first).convert("RGB"))).permute(2, 0, 1)
    images, _ = all_train(dm)
    assert (images.int() - pil.int()).abs().flatten(1).amax(1).min() <= 2
    images, labels = next(iter(dm.train_dataloader()))
    out, _ = dm.augment(images, labels)
    assert out.shape == (64, 3, 32, 32) and abs(out.mean().item()) < 0.5


def test_alternating_flip_moves_its_table_to_the_batch_device_once():
    """On the meta device (a stand-in for an accelerator): one copy of the table, not one per batch."""
    flip = AlternatingFlip(10, seed=0, epoch=lambda: 0)
    images, index = torch.zeros(4, 3, 2, 2, device="meta"), torch.arange(4, device="meta")
    with OpRecorder() as ops:
        for _ in range(3):
            flip(images, index)
    assert flip.start.device.type == "meta"
    assert [c.name for c in ops.calls].count("_to_copy") == 1


def test_two_files_of_one_size_and_mtime_swapped_between_classes_rebuild_the_cache(tmp_path, decode_calls):
    """A cat and a dog image of the same byte size and modification time trade places: the cache is rebuilt and
    each class holds the pixels its file holds now (PIL's decode of the file), not the other's."""
    write_imagefolder(tmp_path / "data")
    cat, dog = tmp_path / "data" / "train" / "cat" / "0000.png", tmp_path / "data" / "train" / "dog" / "0000.png"
    for path, value in ((cat, 10), (dog, 200)):  # uncompressed: equal sizes
        Image.fromarray(np.full((32, 32, 3), value, dtype=np.uint8)).save(path, compress_level=0)
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    make(tmp_path / "data", tmp_path).setup()
    decoded = len(decode_calls)
    stats = [(p.stat().st_size, p.stat().st_mtime_ns) for p in (cat, dog)]
    cat.rename(tmp_path / "swap.png")
    dog.rename(cat)
    (tmp_path / "swap.png").rename(dog)
    assert [(p.stat().st_size, p.stat().st_mtime_ns) for p in (cat, dog)] == stats  # name, size, mtime alike
    make(tmp_path / "data", tmp_path).setup()
    assert len(decode_calls) == 2 * decoded  # rebuilt
    [cache] = cache_files(tmp_path)
    images = torch.load(cache, weights_only=True)["train_images"]
    per_class = len(list(cat.parent.iterdir()))
    for row, path in ((0, cat), (per_class, dog)):  # the first file of each class, in the cache's sorted order
        expected = torch.from_numpy(np.asarray(Image.open(path).convert("RGB"))).permute(2, 0, 1)
        assert torch.equal(images[row], expected), path
