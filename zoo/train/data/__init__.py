"""The data pipeline of training and evaluation, one job a module: ``layout`` finds a data folder's layout
(ImageFolder or CIFAR-10 python batches, downloading only when asked) and raises ``DataError``; ``decode`` turns
the files into uint8 tensors (CIFAR's pickles through ``cifar``, which runs no code); ``cache`` keeps them in one
checksummed file in the user cache directory; ``augment`` holds the batched on-device training augmentation and
``DEFAULT_AUGMENT``; ``module`` is the ``ImageDataModule`` that ties them together for Lightning (loaded on first
use, so the recipes can read ``DEFAULT_AUGMENT`` without importing Lightning). It imports torch, torchvision,
Lightning and ``zoo.atomic`` only: never the models, ``zoo.explain`` or ``zoo.bench`` (which measures this
pipeline from outside)."""

from .augment import DEFAULT_AUGMENT, cutout, random_crop, random_hflip
from .layout import DataError, data_class_names

__all__ = ["DEFAULT_AUGMENT", "DataError", "ImageDataModule", "cutout", "data_class_names", "random_crop",
           "random_hflip"]


def __getattr__(name: str):
    if name == "ImageDataModule":
        from .module import ImageDataModule

        globals()[name] = ImageDataModule
        return ImageDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
