"""The data pipeline of training and evaluation: finding a data folder's layout, decoding it once into a uint8
cache, the LightningDataModule that serves it, and batched on-device augmentation."""

from .module import DEFAULT_AUGMENT, DataError, ImageDataModule, measure_throughput, random_crop, random_hflip

__all__ = ["DEFAULT_AUGMENT", "DataError", "ImageDataModule", "measure_throughput", "random_crop", "random_hflip"]
