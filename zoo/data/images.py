"""The images of training and evaluation: ``ImageData`` finds CIFAR-10 or any ImageFolder tree (``layout``), decodes
it once into a uint8 tensor cache (``decode``, ``cache``), holds it in memory (on the GPU when a run trains on one)
and serves whole batches through a plain Dataset whose ``__getitems__`` indexes the tensors once. When the images
would exceed a memory budget on the device (``stream``), they stay in the memory-mapped cache file instead and
DataLoader workers read the same batches from it (pinned on CUDA). Its loaders yield uint8 (B, 3, H, W) images
with int64 (B,) labels; ``normalize`` turns them into float images normalised with the training split's mean/std
and ``augment`` applies the batched training augmentation on their device. No framework is needed: a training loop
calls these, and so do the evaluations."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from .augment import AlternatingFlip, BatchAugment, augment_config
from .cache import cache_path, load_or_build
from .layout import find_layout
from .samplers import ContiguousShard, EpochOrder, GlobalBatchShard
from .stream import MappedBatches, stream_needed

__all__ = ["ImageData"]


class _TensorBatches(Dataset):
    """Images uint8 (N, 3, H, W) and labels int64 (N,) in memory; ``__getitems__`` returns a whole batch as
    ``(images, labels)`` in one indexing op, so a plain (or a distributed) sampler drives it."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, flip: AlternatingFlip | None = None):
        self.images, self.labels, self.flip = images, labels, flip

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = _to_device(torch.tensor(indices), self.labels.device)
        images = self.images[index]
        return (images if self.flip is None else self.flip(images, index)), self.labels[index]


def _to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on ``device``: on CUDA copied from pinned memory without blocking the host (a copy
    from pageable memory waits for the device to finish its queue); unchanged on the CPU."""
    if device.type == "cpu":
        return index
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


class _TrainLoader(DataLoader):
    """The training DataLoader: creating its iterator starts an epoch of ``order`` (before torch draws anything
    from the shuffle generator), so a checkpoint can name the epoch's data order (``ImageData.order_state``)."""

    def __init__(self, *args, order: EpochOrder, **kwargs):
        super().__init__(*args, **kwargs)
        self.order = order

    def __iter__(self):
        self.order.start_epoch()
        return super().__iter__()


def _as_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The collate function: ``__getitems__`` already returns a batch."""
    return batch


def _check_arguments(sizes: dict[str, int | None], device_cache: str | torch.device,
                     memory_budget: float | None) -> None:
    """ValueError unless each size is None or an int >= 1 (``val_size``, ``stream_workers``: >= 0),
    ``device_cache`` is "auto" or names a device and ``memory_budget`` is None or a number >= 0."""
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not memory_budget >= 0):
        raise ValueError(f"memory_budget must be None or a number of GiB >= 0, got {memory_budget!r}")
    for name, value in sizes.items():
        low = 0 if name in ("val_size", "stream_workers") else 1
        if value is not None and (not isinstance(value, int) or value < low):
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if device_cache != "auto":
        try:
            torch.device(device_cache)
        except RuntimeError as err:
            raise ValueError(f"device_cache must be 'auto' or a device, got {device_cache!r}") from err


class ImageData:
    """CIFAR-10 or an ImageFolder tree as a uint8 tensor cache, with batched on-device augmentation.

    Args:
        data_dir: None -> ``./data`` with torchvision's CIFAR-10 (downloaded there if absent); else a folder
            in ImageFolder layout (train/ and test/ class folders) or one holding ``cifar-10-batches-py``.
            An explicit folder never downloads unless ``download=True``.
        download: fetch CIFAR-10 into ``data_dir`` when it holds no dataset.
        img_size: images are (3, img_size, img_size); other sizes are resized (shorter side), centre-cropped.
        batch_size / eval_batch_size: training / validation+test batch sizes (eval defaults to batch_size), global:
            under several processes each rank takes an equal share (``batch_size`` must divide among them).
        val_size: training images held out for validation (a seeded random split).
        seed: seeds the split, the subsets and the shuffling order (same seed -> same order, epoch by epoch).
        augment: dict with keys of ``DEFAULT_AUGMENT`` overriding them (None -> crop padding 4 + hflip);
            ``randaugment`` is None or ``{"num_ops": 2, "magnitude": 9}``.
        cache_dir: where the cache file goes. Default: ``$XDG_CACHE_HOME/zoo/<hash of the data path>``, or
            ``~/.cache/zoo/<hash of the data path>`` when that variable is unset; never the data folder.
        device_cache: where ``setup`` puts the decoded images: "auto" (the device ``setup`` is given, else the
            CPU) or a device.
        max_train_images / max_test_images: seeded random subsets (only the chosen files are decoded).
        splits: the splits to decode, ("train", "test") or ("test",) for evaluation: a test-only module has no
            mean / std of its own (give them with ``use_normalization``) and cannot be set up for "fit".
        memory_budget: GiB of device memory the decoded images (all splits) may take; above it they stream from
            the memory-mapped cache file (``streamed`` is then True). None: half of the device's free memory.
        stream_workers: DataLoader workers of the streamed path (None: the CPU cores this process may use, less
            one, at most 8).

    After ``setup``: ``num_classes``, ``class_names``, ``mean``, ``std`` (3-tuples in [0, 1] units, of the
    whole train split), ``img_size``, and the datasets ``train_dataset`` / ``val_dataset`` / ``test_dataset``
    (``.images`` uint8 (N, 3, H, W), ``.labels`` int64 (N,)).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        *,
        download: bool = False,
        img_size: int = 32,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        val_size: int = 5000,
        seed: int = 0,
        augment: dict | None = None,
        cache_dir: str | os.PathLike | None = None,
        device_cache: str | torch.device = "auto",
        max_train_images: int | None = None,
        max_test_images: int | None = None,
        splits: Sequence[str] = ("train", "test"),
        memory_budget: float | None = None,
        stream_workers: int | None = None,
    ):
        _check_arguments({"img_size": img_size, "batch_size": batch_size, "eval_batch_size": eval_batch_size,
                          "val_size": val_size, "max_train_images": max_train_images,
                          "max_test_images": max_test_images, "stream_workers": stream_workers}, device_cache,
                         memory_budget)
        if "test" not in splits or not set(splits) <= {"train", "test"}:
            raise ValueError(f"splits must be ('train', 'test') or ('test',), got {splits!r}")
        self.data_dir = Path(data_dir) if data_dir is not None else Path("data")
        self.download = download or data_dir is None
        self.img_size = img_size
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.val_size = val_size
        self.seed = seed
        self.augment_config = augment_config(augment)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self.device_cache = device_cache
        self.max_train_images = max_train_images
        self.max_test_images = max_test_images
        self.splits = tuple(splits)
        self.memory_budget, self.stream_workers = memory_budget, stream_workers
        self.streamed: bool | None = None  # decided in setup
        self.epoch = 0  # the training epoch the loader serves (the alternating flip mirrors by it)
        self._decided: tuple[torch.device, bool] | None = None  # (device, streamed) as decided by the ranks together
        self._device = torch.device("cpu")  # where setup put the images (or copies the streamed batches to)
        self.num_classes: int | None = None
        self.class_names: list[str] | None = None
        self.mean: tuple[float, float, float] | None = None
        self.std: tuple[float, float, float] | None = None
        self.train_dataset = self.val_dataset = self.test_dataset = None
        self._cache: dict | None = None
        self._cache_file: Path | None = None
        self._held = None  # the cache file as loaded, held open for the streamed datasets (``_snapshot``)
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._shuffle = torch.Generator().manual_seed(seed)
        self._order = EpochOrder(self._shuffle)  # the data order's place, in checkpoints (state_dict)
        self._augment: BatchAugment | None = None  # built once num_classes is known

    # ---------------------------------------------------------------- cache

    def cache_path(self, source: Path) -> Path:
        """The cache file for data read from ``source`` with this module's size and subset settings."""
        return cache_path(source, self.cache_dir, self.img_size, self._limits(), self.seed)

    def _limits(self) -> dict[str, int | None]:
        return {"train": self.max_train_images if "train" in self.splits else 0, "test": self.max_test_images}

    def prepare_data(self) -> None:
        """Find the data (downloading CIFAR-10 only where allowed) and build or validate the uint8 cache, once per
        object: validating stats every data file."""
        self._cache = self._cache if self._cache is not None else self._load_or_build()
        self._read_facts()

    def _read_facts(self) -> None:
        """The classes and the training split's statistics, from the cache."""
        cache = self._cache
        self.class_names = list(cache["class_names"])
        self.num_classes = len(self.class_names)
        if cache["mean"] is not None:  # a test-only cache has none: use_normalization gives them
            self.mean, self.std = tuple(cache["mean"]), tuple(cache["std"])

    @property
    def num_train_images(self) -> int:
        """The training split's images (less the validation images) as decoded (0 before ``prepare_data``); a
        validation split of all of them or more -> ValueError."""
        if self._cache is None:
            return 0
        n = len(self._cache["train_labels"])
        if self.val_size >= n:
            raise ValueError(f"val_size must be below the {n} training images, got {self.val_size}")
        return n - self.val_size

    @property
    def num_test_images(self) -> int:
        """The test split's images as decoded (0 before ``prepare_data`` / ``setup``)."""
        return len(self._cache["test_labels"]) if self._cache is not None else 0

    def source(self) -> Path:
        """The folder the data is read from (an ImageFolder root or cifar-10-batches-py); DataError if none."""
        return find_layout(self.data_dir, self.download)[1]

    def _load_or_build(self) -> dict:
        layout, source = find_layout(self.data_dir, self.download)
        self._cache_file = self.cache_path(source)
        cache = load_or_build(layout, source, self._cache_file, self.img_size, self._limits(), self.seed)
        if self._held is not None:
            self._held.close()
        if self._cache_file.is_file():  # held from now on: a cache rebuilt by another process is another file
            self._held = open(self._cache_file, "rb")  # noqa: SIM115 (open while the module streams from it)
        return cache

    def _snapshot(self) -> Path:
        """Where the streamed datasets read the cache file this module loaded: ``/proc/<pid>/fd/<n>`` of the file it
        holds open (DataLoader workers open that too), so a cache that another process rebuilds meanwhile (written
        beside it and renamed over it) does not change the images under a run; the cache's path where there is no
        /proc."""
        if self._held is not None:
            held = Path(f"/proc/{os.getpid()}/fd/{self._held.fileno()}")
            if held.exists():
                return held
        return self._cache_file

    # ---------------------------------------------------------------- setup and loaders

    def setup(self, stage: str | None = None, device: torch.device | str | None = None,
              agree: Callable[[bool], bool] | None = None) -> None:
        """Load the cache (building it if needed), split off the seeded validation set and put the images on
        ``device`` (with ``device_cache`` "auto"; else where ``device_cache`` says), or leave them in the cache file
        when they exceed the memory budget there. ``stage``: "fit" (train and validation splits), "test", or None
        (all). ``agree``: under several processes, a collective that makes the streaming decision one for all ranks
        (True where any rank's is True); every rank calls ``setup`` together then."""
        if self._cache is None:
            self._cache = self._load_or_build()
        cache = self._cache
        if self.class_names is None:
            self._read_facts()
        self._stats.clear()
        self._augment = BatchAugment(self.augment_config, self.num_classes)
        device = self._cache_device(device)
        self._device = device
        self.streamed = self._stream(cache, device, agree)
        if stage in (None, "fit") and "train" not in self.splits:
            raise ValueError(f"this data decoded only {self.splits}: it cannot be set up for {stage!r}")
        if stage in (None, "fit"):
            n = len(cache["train_labels"])
            if self.val_size >= n:
                raise ValueError(f"val_size must be below the {n} training images, got {self.val_size}")
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
            val_idx, train_idx = order[: self.val_size].sort().values, order[self.val_size:].sort().values
            images, labels = cache["train_images"], cache["train_labels"]
            flip = None
            if self.augment_config["hflip"] and self.augment_config["alternating_flip"]:
                flip = AlternatingFlip(len(train_idx), self.seed, self._current_epoch)
            if self.streamed:
                self.train_dataset = MappedBatches(self._snapshot(), "train", train_idx, labels[train_idx], flip)
                self.val_dataset = MappedBatches(self._snapshot(), "train", val_idx, labels[val_idx])
            else:
                self.train_dataset = _TensorBatches(images[train_idx].to(device), labels[train_idx].to(device), flip)
                self.val_dataset = _TensorBatches(images[val_idx].to(device), labels[val_idx].to(device))
        if stage in (None, "test"):
            images, labels = cache["test_images"], cache["test_labels"]
            self.test_dataset = (MappedBatches(self._snapshot(), "test", None, labels) if self.streamed
                                 else _TensorBatches(images.to(device), labels.to(device)))

    def _stream(self, cache: dict, device: torch.device, agree: Callable[[bool], bool] | None) -> bool:
        """Whether the decoded images exceed the memory budget on ``device`` (with ``agree``: on any rank, so all
        ranks then stream); a streamed run needs the cache file, so one that could not be written -> ValueError.
        Decided once per device: a later ``setup`` (the test's after the fit's) keeps the choice, as the device's
        free memory then excludes the resident training images, the model and the optimizer."""
        if self._decided is not None and self._decided[0] == device:
            return self._decided[1]
        nbytes = cache["train_images"].nbytes + cache["test_images"].nbytes
        stream = stream_needed(nbytes, device, self.memory_budget)
        if agree is not None:
            stream = agree(stream)
        if stream and (self._cache_file is None or not self._cache_file.is_file()):
            raise ValueError(f"the {nbytes / 2**30:.2f} GiB of decoded images exceed the memory budget on {device} "
                             f"and are read from the cache file, which could not be written: give a writable "
                             f"--cache-dir")
        self._decided = (device, stream)
        return stream

    def order_state(self, batches_done: int, epoch_done: bool) -> dict:
        """For a checkpoint: where the training data order stands (``samplers.EpochOrder``) after ``batches_done``
        global batches of the current epoch, or at the start of the next one (``epoch_done``)."""
        return self._order.state_dict(batches_done, epoch_done)

    def load_order_state(self, state: dict) -> None:
        """Continue the data order ``order_state`` described: the next training loader starts where it stood."""
        self._order.load_state_dict(state)

    def _current_epoch(self) -> int:
        return self.epoch

    def _cache_device(self, device: torch.device | str | None) -> torch.device:
        if self.device_cache != "auto":
            return torch.device(self.device_cache)
        return torch.device(device) if device is not None else torch.device("cpu")

    def _ranks(self) -> tuple[int, int]:
        """``(world size, global rank)`` of the open process group (a run or an evaluation on several processes),
        else ``(1, 0)``."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    def _loader(self, dataset: _TensorBatches | MappedBatches | None, name: str, train: bool) -> DataLoader:
        if dataset is None:
            raise ValueError(f"the {name} split is not loaded: call setup() ('fit' or 'test') first")
        world, rank = self._ranks()
        workers = self._workers() if isinstance(dataset, MappedBatches) else {"num_workers": 0}
        if train:  # batch_size is the global batch: this rank's slice of each one
            sampler = GlobalBatchShard(dataset, self.batch_size, world, rank, self._shuffle, self._order.take_skip)
            return _TrainLoader(dataset, batch_size=sampler.local_batch, sampler=sampler, generator=self._shuffle,
                                collate_fn=_as_batch, order=self._order, **workers)
        return DataLoader(dataset, batch_size=-(-self.eval_batch_size // world),
                          sampler=ContiguousShard(dataset, world, rank), collate_fn=_as_batch, **workers)

    def _workers(self) -> dict:
        """The streamed path's DataLoader arguments: workers reading the memory map, pinned batches on CUDA."""
        workers = self.stream_workers
        if workers is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            workers = min(8, max(cores - 1, 0))
        return {"num_workers": workers, "pin_memory": self._device.type == "cuda"}

    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded; a new order each epoch) uint8 batches; the last incomplete batch is dropped. Under
        several processes ``batch_size`` is the global batch and each rank gets its slice of it
        (``samplers.GlobalBatchShard``); validation and test shards are unpadded (``ContiguousShard``)."""
        return self._loader(self.train_dataset, "train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, "validation", train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_dataset, "test", train=False)

    # ---------------------------------------------------------------- transforms

    def _mean_std(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mean is None:
            raise ValueError("mean/std are unknown until prepare_data() or setup() has read the data")
        if device not in self._stats:
            self._stats[device] = tuple(torch.tensor(v, device=device).view(1, 3, 1, 1)
                                        for v in (self.mean, self.std))
        return self._stats[device]

    def use_normalization(self, mean: Sequence[float], std: Sequence[float]) -> None:
        """Normalise with these per-channel statistics (a pretrained model's) instead of the training split's."""
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError(f"mean and std must be 3 values each, std > 0; got {mean}, {std}")
        self.mean, self.std = tuple(map(float, mean)), tuple(map(float, std))
        self._stats.clear()

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, 3, H, W) in [0, 255] (or float in [0, 1]) -> float32 ``(x / 255 - mean) / std``."""
        mean, std = self._mean_std(images.device)
        x = images.float() / 255 if images.dtype == torch.uint8 else images.float()
        return (x - mean) / std

    def denormalize(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised float (B, 3, H, W) -> float images in [0, 1] (for drawing)."""
        mean, std = self._mean_std(images.device)
        return (images * std + mean).clamp(0, 1)

    def augment(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training transform of a uint8 batch: crop, flip, RandAugment per image (uint8), normalise, cutout,
        mixup/cutmix.

        Returns float32 (B, 3, H, W) and labels: int64 (B,), or (B, num_classes) float probabilities when
        mixup/cutmix is active."""
        if self._augment is None:
            raise ValueError("the augmentation needs the number of classes: call setup() first")
        world, rank = self._ranks()  # the batch is this rank's slice of the global batch
        return self._augment(images, labels, self.normalize, shard=(rank, world))
