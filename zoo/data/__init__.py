"""The images of training and evaluation, one job a module: ``layout`` finds a data folder's layout (ImageFolder or
CIFAR-10 python batches, downloading only when asked) and raises ``DataError``; ``decode`` turns the files into uint8
tensors (CIFAR's pickles through ``cifar``, which runs no code); ``cache`` keeps them in one checksummed file in the
user cache directory; ``stream`` serves them from that file when they do not fit the device; ``augment`` and
``randaugment`` hold the batched on-device training augmentation and ``DEFAULT_AUGMENT``; ``samplers`` says which
images each optimizer step takes on each process; ``images`` is ``ImageData``, which ties them together;
``run_data`` finds the test data a trained run was made for. Imports torch, torchvision and ``zoo.atomic`` only:
never the models, training or explaining (which all read data through here)."""

from .augment import DEFAULT_AUGMENT, cutout, random_crop, random_hflip
from .decode import data_class_names
from .images import ImageData
from .layout import DataError

__all__ = ["DEFAULT_AUGMENT", "DataError", "ImageData", "cutout", "data_class_names", "random_crop",
           "random_hflip"]
