"""``fit``: one resumable training run from a resolved recipe: data, run directory, model, callbacks,
Lightning Trainer, test, summary.json."""

from __future__ import annotations

import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, Timer, TQDMProgressBar

from ..models import model_info
from .callbacks import Throughput, TimeBudget
from .device import resolve_accelerator, resolve_precision
from .module import ImageClassifier


def fit(cfg: dict) -> Path:
    """Train one run from a resolved config (``zoo.config.resolve_config``) and return its run directory,
    which holds config.yaml, metrics.csv, checkpoints/{last,best}.ckpt and summary.json. With
    ``cfg["resume"]`` ("auto" or a run directory / checkpoint) the run continues where its last.ckpt ends."""
    from ..models.checkpoints import load_pretrained
    from .data import ImageDataModule
    from .recipe import parse_max_time
    from .runs import AtomicCheckpointIO, ResumableCSVLogger, prepare_run_dir, write_json

    accelerator = resolve_accelerator(cfg["accelerator"], cfg["devices"])
    precision = resolve_precision(cfg["precision"], accelerator)
    dm = ImageDataModule(
        cfg["data_dir"], download=cfg["download"], img_size=cfg["img_size"], batch_size=cfg["batch_size"],
        eval_batch_size=cfg["eval_batch_size"], val_size=cfg["val_size"], seed=cfg["seed"],
        augment=cfg["augment"], cache_dir=cfg["cache_dir"], max_train_images=cfg["max_train_images"],
        max_test_images=cfg["max_test_images"])
    dm.prepare_data()
    dm.setup("fit")
    run_dir, ckpt_path = prepare_run_dir(cfg)
    pl.seed_everything(cfg["seed"], workers=True, verbose=False)

    channels_last = cfg["channels_last"]
    if channels_last == "auto":
        channels_last = accelerator == "gpu" and cfg["model"].startswith(("resnet", "hybrid"))
    model_args = {**cfg["model_args"], "img_size": cfg["img_size"]}  # every zoo model takes img_size
    module = ImageClassifier(
        cfg["model"], model_args, num_classes=dm.num_classes, lr=cfg["lr"],
        weight_decay=cfg["weight_decay"],
        warmup_frac=min(cfg["warmup_epochs"] / max(cfg["epochs"], 1), 1.0), min_lr_ratio=cfg["min_lr_ratio"],
        label_smoothing=cfg["label_smoothing"], channels_last=bool(channels_last), compile=cfg["compile"])
    if cfg["init_from"] and ckpt_path is None:
        load_pretrained(module.model, cfg["init_from"])

    ckpt_dir = run_dir / "checkpoints"
    best = ModelCheckpoint(ckpt_dir, "best", monitor="val/top1", mode="max", save_top_k=1, save_last=True,
                           enable_version_counter=False)
    steps = ModelCheckpoint(ckpt_dir, "last", save_top_k=0, save_last=True,
                            every_n_train_steps=cfg["ckpt_every_n_steps"], enable_version_counter=False)
    throughput = Throughput()
    callbacks = [best, steps, throughput, TQDMProgressBar(refresh_rate=1 if accelerator == "cpu" else 20),
                 LearningRateMonitor("step")]
    if cfg["max_time"]:
        callbacks += [TimeBudget(parse_max_time(cfg["max_time"])), Timer(cfg["max_time"])]
    logger = ResumableCSVLogger(run_dir, resume_from=ckpt_path)

    trainer = pl.Trainer(
        accelerator=accelerator, devices=cfg["devices"], strategy=cfg["strategy"], num_nodes=cfg["num_nodes"],
        precision=precision, max_epochs=cfg["epochs"], logger=logger, callbacks=callbacks,
        plugins=[AtomicCheckpointIO()], limit_train_batches=cfg["limit_train_batches"],
        limit_val_batches=cfg["limit_val_batches"], limit_test_batches=cfg["limit_test_batches"],
        log_every_n_steps=min(50, cfg["ckpt_every_n_steps"]),
        num_sanity_val_steps=0)
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt_path) if ckpt_path else None)
    fit_s = time.perf_counter() - start
    tested = best.best_model_path if best.best_model_path and Path(best.best_model_path).exists() else None
    results = trainer.test(module, datamodule=dm, ckpt_path=tested)[0]

    if trainer.is_global_zero:
        info = model_info(module.model)
        write_json(run_dir / "summary.json", {
            "model": cfg["model"], "params": info["params"], "flops": info["flops"], "precision": precision,
            "accelerator": accelerator, "devices": trainer.num_devices * trainer.num_nodes,
            "epochs": trainer.current_epoch, "global_step": trainer.global_step,
            "wall_time_s": round(fit_s, 2),
            "train_images_per_s": round(throughput.images_per_s, 1),
            "best_val_top1": float(best.best_model_score) if best.best_model_score is not None else None,
            "test_top1": float(results["test/top1"]), "test_top5": float(results["test/top5"]),
            "test_loss": float(results["test/loss"]), "tested_checkpoint": Path(tested or "last").name,
            "num_classes": dm.num_classes, "class_names": list(dm.class_names), "img_size": dm.img_size,
            "mean": list(dm.mean), "std": list(dm.std),
        })
    return run_dir
