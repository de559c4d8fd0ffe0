"""A helper the distributed tests launch (plainly, under Lightning's DDP, torchrun or simulated SLURM); not a test.

    python ddp_driver.py train TRAIN_ARGS...   train.py's main with a recorder: each rank writes
        $ZOO_TEST_RECORD/rank<R>.json (the (global step, learning rate) of every optimizer step, the time budget's
        fitted step count, batches per epoch) and rank<R>.pt (its final weights), and every summary.json / config.yaml
        write is logged to writes-rank<R>.txt. ZOO_TEST_SKEW=S makes rank 1 start its clock S seconds late;
        ZOO_TEST_NAN_AT=K flags a non-finite loss on rank 1 alone at step K; ZOO_TEST_MEASURE=SKIP,STEPS makes the
        time budget measure the step time over STEPS steps after SKIP (a short test reaches its decision sooner).
    python ddp_driver.py test CKPT DATA_DIR N DEVICES CACHE_DIR   eval.py --checkpoint CKPT on N test images (its
        files in $ZOO_TEST_RECORD/eval), then Lightning's test of CKPT (``lightning_test``) with DEVICES CPU
        processes; rank 0 writes $ZOO_TEST_RECORD/test.json with the logged metrics."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

RECORD = Path(os.environ.get("ZOO_TEST_RECORD", "."))


def rank() -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("LOCAL_RANK", 0))


class Recorder(pl.Callback):
    def __init__(self):
        self.steps: list[tuple[int, float]] = []

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 1:  # before the time budget's clock starts (this callback comes first)
            time.sleep(float(os.environ.get("ZOO_TEST_SKEW", 0)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"]))
        if trainer.global_rank == 1 and str(trainer.global_step) == os.environ.get("ZOO_TEST_NAN_AT"):
            pl_module.first_bad_step.fill_(trainer.global_step)  # as if rank 1 alone had seen a NaN loss here

    def on_train_end(self, trainer, pl_module):
        from zoo.train.callbacks import TimeBudget

        budget = next((c for c in trainer.callbacks if isinstance(c, TimeBudget)), None)
        record = {"global_step": trainer.global_step, "steps": self.steps,
                  "total_steps": budget.total_steps if budget else None,
                  "batches_per_epoch": trainer.num_training_batches, "world_size": trainer.world_size}
        (RECORD / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
        torch.save(pl_module.state_dict(), RECORD / f"rank{trainer.global_rank}.pt")


def train(argv: list[str]) -> int:
    from zoo.train import cli, fit, runs
    from zoo.train.callbacks import TimeBudget

    build_callbacks, write_json, write = fit.build_callbacks, fit.atomic_write_json, runs.atomic_write
    write_text = runs.atomic_write_text  # config.yaml

    def with_recorder(plan, *args, **kwargs):  # build_callbacks' own arguments, whatever they are
        callbacks = build_callbacks(plan, *args, **kwargs)
        callbacks.all.insert(0, Recorder())
        if os.environ.get("ZOO_TEST_MEASURE"):
            skip, steps = map(int, os.environ["ZOO_TEST_MEASURE"].split(","))
            for budget in (c for c in callbacks.all if isinstance(c, TimeBudget)):
                budget.skip_steps, budget.measure_steps = skip, steps
        return callbacks

    def logged(writer):
        def write_logged(path, *args):
            with open(RECORD / f"writes-rank{rank()}.txt", "a") as f:
                f.write(Path(path).name + "\n")
            return writer(path, *args)
        return write_logged

    fit.build_callbacks, fit.atomic_write_json, runs.atomic_write = with_recorder, logged(write_json), logged(write)
    runs.atomic_write_text = logged(write_text)
    return cli.main(argv)


def lightning_test(ckpt: str, data_dir: str, num_images: int, devices: int, cache_dir: str) -> dict | None:
    """Lightning's test of a run's checkpoint (without test-time augmentation) on ``num_images`` seeded test images
    with ``devices`` CPU processes; the logged metrics on rank 0, None on the others."""
    from zoo.train.data import ImageDataModule
    from zoo.train.module import ImageClassifier

    module = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu", tta=0)
    dm = ImageDataModule(data_dir, max_test_images=num_images, eval_batch_size=64, splits=("test",),
                         cache_dir=cache_dir)
    summary = json.loads((Path(ckpt).parent.parent / "summary.json").read_text())
    dm.use_normalization(summary["mean"], summary["std"])
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    results = trainer.test(module, datamodule=dm, verbose=False)[0]
    return {k: float(v) for k, v in results.items()} if trainer.is_global_zero else None


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "train":
        sys.exit(train(args))
    from zoo.explain.cli import main as eval_main

    code = eval_main(["--checkpoint", args[0], "--data-dir", args[1], "--max-test-images", args[2], "--cache-dir",
                      args[4], "--device", "cpu", "--batch-size", "64", "--out", str(RECORD / "eval")])
    if code:
        sys.exit(code)
    results = lightning_test(args[0], args[1], int(args[2]), int(args[3]), args[4])
    if results is not None:
        (RECORD / "test.json").write_text(json.dumps(results))
