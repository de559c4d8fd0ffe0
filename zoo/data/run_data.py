"""The test data a trained run was made for, as its config.yaml and summary.json record it: one function that
``eval.py`` (every mode) and ``zoo.train.publish`` share."""

from __future__ import annotations

from .images import ImageData


def data_for_run(meta: dict, *, data_dir: str | None = None, batch_size: int = 256,
                    max_test_images: int | None = None, cache_dir: str | None = None) -> ImageData:
    """The test data a run was trained for: its config's data folder, image size, split and cache
    (``data_dir`` / ``cache_dir`` override them), set up for testing; zoo.data.DataError when the data is not
    there. The run's training cache is used when it exists; otherwise, when the run recorded its normalisation
    (summary.json mean / std), only the test split is decoded."""
    cfg, summary = meta.get("config") or {}, meta.get("summary") or {}
    options = dict(download=False, img_size=cfg.get("img_size", 32), batch_size=batch_size,
                   val_size=cfg.get("val_size", 5000), seed=cfg.get("seed", 0), device_cache="cpu",
                   cache_dir=cache_dir if cache_dir is not None else cfg.get("cache_dir"),
                   max_train_images=cfg.get("max_train_images"), max_test_images=max_test_images)
    folder = data_dir if data_dir is not None else cfg.get("data_dir")
    dm = ImageData(folder, **options)
    stats = summary.get("mean"), summary.get("std")
    if None not in stats and not dm.cache_path(dm.source()).is_file():
        dm = ImageData(folder, splits=("test",), **options)
        dm.use_normalization(*stats)
    dm.prepare_data()
    dm.setup("test")
    return dm
