"""Batched training augmentation on the batch's own device: random crop with zero padding and horizontal flip
(vectorised over the batch, no loop over images), optional RandAugment (Cubuk et al. 2019,
https://arxiv.org/abs/1909.13719, ``randaugment.RandAugment``: torchvision's ops drawn per image, on uint8, without
host sync), then mixup (Zhang et al. 2017,
https://arxiv.org/abs/1710.09412) and cutmix (Yun et al. 2019, https://arxiv.org/abs/1905.04899) on the
normalised float batch (after cutout, DeVries & Taylor 2017, https://arxiv.org/abs/1708.04552: a zeroed
square per image, as airbench96 uses for its longer runs), which turn the labels into (B, num_classes) float
probabilities. With
``alternating_flip`` (airbench) the dataset mirrors each image in alternate epochs from a seeded random start
(``AlternatingFlip``) instead of a fresh coin per batch, so every image is seen both ways every two epochs.
``DEFAULT_AUGMENT`` is the one definition of the augmentation settings and their defaults (the recipes read it too)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchvision.transforms import v2

from .randaugment import RandAugment

DEFAULT_AUGMENT = {
    "crop_padding": 4, "hflip": True, "alternating_flip": False, "randaugment": None, "mixup_alpha": 0.0,
    "cutmix_alpha": 0.0, "cutout": 0,
}
RANDAUGMENT_DEFAULTS = {"num_ops": 2, "magnitude": 9}


def crop_offsets(n: int, padding: int, device: torch.device) -> torch.Tensor:
    """(n, 2) int64 (top, left) crop offsets, uniform in [0, 2 * padding]."""
    return torch.randint(0, 2 * padding + 1, (n, 2), device=device)


def flip_coins(n: int, device: torch.device) -> torch.Tensor:
    """(n,) bool, each True with p = 0.5: which images to mirror."""
    return torch.rand(n, device=device) < 0.5


def cutout_corners(n: int, height: int, width: int, size: int, device: torch.device) -> torch.Tensor:
    """(n, 2) int64 (top, left) corners of ``size`` x ``size`` squares, uniform inside a height x width image."""
    return torch.stack([torch.randint(0, height - size + 1, (n,), device=device),
                        torch.randint(0, width - size + 1, (n,), device=device)], dim=1)


def random_crop(images: torch.Tensor, padding: int, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Random crop of (B, C, H, W) images after zero padding by ``padding`` on each side, one crop per image.

    ``offsets`` (B, 2) int64 (top, left) in [0, 2 * padding]; drawn uniformly when None. Vectorised: one
    ``gather`` of each image's H x W window from the flattened padded images, no loop over images."""
    if padding == 0:
        return images
    b, c, h, w = images.shape
    if offsets is None:
        offsets = crop_offsets(b, padding, images.device)
    padded = torch.nn.functional.pad(images, (padding,) * 4)  # (B, C, H + 2p, W + 2p)
    rows = offsets[:, 0, None] + torch.arange(h, device=images.device)  # (B, H)
    cols = offsets[:, 1, None] + torch.arange(w, device=images.device)  # (B, W)
    window = rows[:, :, None] * padded.shape[-1] + cols[:, None, :]  # (B, H, W) flat positions
    window = window.view(b, 1, h * w).expand(b, c, h * w)
    return padded.flatten(2).gather(2, window).view(b, c, h, w)


def random_hflip(images: torch.Tensor, flip: torch.Tensor | None = None) -> torch.Tensor:
    """Mirror (B, C, H, W) images left-right where ``flip`` (B,) bool is True (drawn with p = 0.5 if None)."""
    if flip is None:
        flip = flip_coins(images.shape[0], images.device)
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


def cutout(images: torch.Tensor, size: int, corners: torch.Tensor | None = None) -> torch.Tensor:
    """Zero a ``size`` x ``size`` square of each (B, C, H, W) image (0 is the mean of normalised images).

    ``corners`` (B, 2) int64 (top, left) in [0, H - size] x [0, W - size], so the square lies inside the
    image; drawn uniformly when None. Vectorised: one (B, H, W) mask, no loop over images."""
    b, _, h, w = images.shape
    if size == 0:
        return images
    if size > min(h, w):
        raise ValueError(f"augment cutout {size} is larger than the {h}x{w} images; use at most {min(h, w)}")
    if corners is None:
        corners = cutout_corners(b, h, w, size, images.device)
    rows = torch.arange(h, device=images.device) - corners[:, :1]  # (B, H): offset from the square's top
    cols = torch.arange(w, device=images.device) - corners[:, 1:]  # (B, W)
    inside = ((rows >= 0) & (rows < size))[:, :, None] & ((cols >= 0) & (cols < size))[:, None, :]
    return images.masked_fill(inside[:, None], 0.0)


def randaugment_args(spec: dict | bool | None) -> dict | None:
    """``RandAugment``'s keyword arguments for an ``augment["randaugment"]`` value (None / False: off, True: the
    defaults, a dict: overrides of ``RANDAUGMENT_DEFAULTS``); bad values -> ValueError."""
    if not spec:
        return None
    spec = {} if spec is True else spec
    if not isinstance(spec, dict):
        raise ValueError(f"augment randaugment must be None, a bool or a mapping, got {spec!r}")
    unknown = sorted(set(spec) - set(RANDAUGMENT_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown randaugment keys {unknown}; expected some of {sorted(RANDAUGMENT_DEFAULTS)}")
    args = {**RANDAUGMENT_DEFAULTS, **spec}
    RandAugment(**args)  # checks the values
    return args


def augment_config(augment: dict | None) -> dict:
    """``DEFAULT_AUGMENT`` updated with ``augment``, checked: unknown keys or bad values -> ValueError."""
    unknown = sorted(set(augment or {}) - set(DEFAULT_AUGMENT))
    if unknown:
        raise ValueError(f"unknown augment keys {unknown}; expected some of {sorted(DEFAULT_AUGMENT)}")
    config = {**DEFAULT_AUGMENT, **(augment or {})}
    if not isinstance(config["crop_padding"], int) or config["crop_padding"] < 0:
        raise ValueError(f"augment crop_padding must be an int >= 0, got {config['crop_padding']!r}")
    if not isinstance(config["cutout"], int) or isinstance(config["cutout"], bool) or config["cutout"] < 0:
        raise ValueError(f"augment cutout must be an int >= 0 (the square's side in pixels), got "
                         f"{config['cutout']!r}")
    for key in ("mixup_alpha", "cutmix_alpha"):
        if not isinstance(config[key], (int, float)) or config[key] < 0:
            raise ValueError(f"augment {key} must be a number >= 0, got {config[key]!r}")
    randaugment_args(config["randaugment"])
    return config


def make_mix(config: dict, num_classes: int) -> v2.Transform | None:
    """torchvision's MixUp / CutMix (one of them at random per batch when both are on), or None."""
    mixes = [cls(alpha=float(config[key]), num_classes=num_classes)
             for cls, key in ((v2.MixUp, "mixup_alpha"), (v2.CutMix, "cutmix_alpha")) if config[key] > 0]
    if not mixes:
        return None
    return mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)


class AlternatingFlip:
    """Which of N images to mirror in an epoch: a seeded random half in even epochs, the other half in odd
    ones. ``epoch`` is a callable returning the current epoch (the trainer's), read at every batch."""

    def __init__(self, num_images: int, seed: int, epoch: Callable[[], int]):
        self.start = torch.rand(num_images, generator=torch.Generator().manual_seed(seed)) < 0.5
        self.epoch = epoch

    def __call__(self, images: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) of dataset rows ``index`` (B,), mirrored where this epoch says so."""
        if self.start.device != index.device:  # moved once, not copied from host memory at every batch
            self.start = self.start.to(index.device)
        flip = self.start[index] ^ bool(self.epoch() % 2)
        return random_hflip(images, flip)


class BatchAugment:
    """The training transform of a uint8 batch: crop, flip, RandAugment per image (uint8), normalise, cutout,
    mixup/cutmix; all on the batch's device, without host sync.

    Args:
        augment: settings overriding ``DEFAULT_AUGMENT`` (checked by ``augment_config``).
        num_classes: the width of the soft labels mixup/cutmix produce.
    """

    def __init__(self, augment: dict | None, num_classes: int):
        self.config = augment_config(augment)
        self.crop_padding = self.config["crop_padding"]
        self.hflip = self.config["hflip"] and not self.config["alternating_flip"]  # else the dataset flips
        args = randaugment_args(self.config["randaugment"])
        self.randaugment = RandAugment(**args) if args is not None else None
        self.mix = make_mix(self.config, num_classes)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, normalize: Callable[[torch.Tensor], torch.Tensor],
                 shard: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 (B, 3, H, W) images and int64 (B,) labels -> float32 images (``normalize`` turns the uint8
        batch into floats) and labels: int64 (B,), or (B, num_classes) float probabilities with mixup/cutmix.

        ``shard`` (rank, world size): the batch is slice ``rank`` of a global batch of ``world size`` such slices
        (``GlobalBatchShard``). Every per-image draw (crop, flip, RandAugment, cutout) is made for the whole global
        batch, as every rank makes it (their generators agree), and this rank takes its slice: each image of a
        global batch is augmented as in one process, and no two ranks augment alike."""
        rank, world = shard
        b, device = images.shape[0], images.device
        mine = slice(rank * b, (rank + 1) * b)
        if self.crop_padding:
            images = random_crop(images, self.crop_padding, crop_offsets(world * b, self.crop_padding, device)[mine])
        if self.hflip:
            images = random_hflip(images, flip_coins(world * b, device)[mine])
        if self.randaugment is not None:
            ops, signs = self.randaugment.draw(world * b, device)
            images = self.randaugment(images, draws=(ops[:, mine], signs[:, mine]))
        size, (h, w) = self.config["cutout"], images.shape[-2:]
        # (no square: nothing to draw; a larger one than the image: cutout's own error)
        corners = cutout_corners(world * b, h, w, size, device)[mine] if 0 < size <= min(h, w) else None
        images = cutout(normalize(images), size, corners)
        if self.mix is not None:  # one mixing weight per batch, the same on every rank (torch's CPU generator)
            images, labels = self.mix(images, labels)
        return images, labels
