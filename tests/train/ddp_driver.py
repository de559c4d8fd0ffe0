"""A helper the distributed tests launch (plainly, under Fabric's own launcher, torchrun or simulated SLURM); not a
test.

    python ddp_driver.py train TRAIN_ARGS...   train.py's main with a recorder among the loop's callbacks: each rank
        writes $ZOO_TEST_RECORD/rank<R>.json (the (global step, learning rate) of every optimizer step, the time
        budget's fitted step count, batches per epoch) and rank<R>.pt (its final weights), and every summary.json /
        config.yaml / checkpoint write is logged to writes-rank<R>.txt. ZOO_TEST_SKEW=S makes rank 1 start training
        S seconds late; ZOO_TEST_NAN_AT=K flags a non-finite loss on rank 1 alone at step K; ZOO_TEST_MEASURE=
        SKIP,STEPS makes the clock measure the step time over STEPS steps after SKIP (a short test reaches its
        decision sooner).
    python ddp_driver.py test CKPT DATA_DIR N CACHE_DIR   eval.py --checkpoint CKPT on N test images (its files in
        $ZOO_TEST_RECORD/eval), then the same checkpoint tested on every process of the launch by the loop's own
        evaluation (``loop.evaluate`` on Fabric) and by a plain ``lightning.Trainer`` with ``ImageClassifier``; rank
        0 writes $ZOO_TEST_RECORD/test.json with both."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

RECORD = Path(os.environ.get("ZOO_TEST_RECORD", "."))


def rank() -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("LOCAL_RANK", 0))


class Recorder:
    def __init__(self):
        self.steps: list[tuple[int, float]] = []

    def on_train_start(self, run):
        if run.fabric.global_rank == 1:
            time.sleep(float(os.environ.get("ZOO_TEST_SKEW", 0)))

    def on_train_batch_end(self, run):
        step = run.position.step
        self.steps.append((step, run.optimizer.param_groups[0]["lr"]))
        if run.fabric.global_rank == 1 and str(step) == os.environ.get("ZOO_TEST_NAN_AT"):
            run.first_bad_step.fill_(step)  # as if rank 1 alone had seen a NaN loss here

    def on_train_end(self, run):
        record = {"global_step": run.position.step, "steps": self.steps, "total_steps": run.clock.total_steps,
                  "batches_per_epoch": run.steps_per_epoch, "world_size": run.fabric.world_size}
        (RECORD / f"rank{run.fabric.global_rank}.json").write_text(json.dumps(record))
        torch.save(run.net.state_dict(), RECORD / f"rank{run.fabric.global_rank}.pt")


def train(argv: list[str]) -> int:
    from zoo.train import cli, loop, runs
    from zoo.train.clock import RunClock

    if os.environ.get("ZOO_TEST_MEASURE"):
        RunClock.SKIP, RunClock.MEASURE = map(int, os.environ["ZOO_TEST_MEASURE"].split(","))

    def logged(writer):
        def write_logged(path, *args):
            with open(RECORD / f"writes-rank{rank()}.txt", "a") as f:
                f.write(Path(path).name + "\n")
            return writer(path, *args)
        return write_logged

    loop.atomic_write_json = logged(loop.atomic_write_json)  # summary.json
    runs.atomic_write = logged(runs.atomic_write)  # checkpoints
    runs.atomic_write_text = logged(runs.atomic_write_text)  # config.yaml
    loop.fit = functools.partial(loop.fit, callbacks=[Recorder()])
    return cli.main(argv)


def test(ckpt: str, data_dir: str, num_images: int, cache_dir: str) -> dict | None:
    """The checkpoint (without test-time augmentation) on ``num_images`` seeded test images, on every process of
    this launch: the loop's evaluation and Lightning's test; their metrics on rank 0, None on the others."""
    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from zoo.data import ImageData
    from zoo.data.samplers import ContiguousShard
    from zoo.models import load_run
    from zoo.train import ImageClassifier, loop
    from zoo.train.clock import RunClock
    from zoo.train.progress import Progress

    world = int(os.environ.get("WORLD_SIZE", 1))
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", precision="32-true")
    fabric.launch()
    model, meta = load_run(ckpt)
    data = ImageData(data_dir, max_test_images=num_images, eval_batch_size=64, splits=("test",), cache_dir=cache_dir)
    data.use_normalization(meta["summary"]["mean"], meta["summary"]["std"])
    data.setup("test")
    loader = data.test_dataloader()
    run = SimpleNamespace(fabric=fabric, net=model, data=data, ema=None, memory_format=torch.contiguous_format,
                          progress=Progress(False), clock=RunClock(budget_s=None, scheduled_steps=1, steps_per_epoch=1,
                                                                   val_batches=0),
                          plan=SimpleNamespace(recipe=SimpleNamespace(label_smoothing=meta["summary"]["label_smoothing"],
                                                                      tta=0)))
    scores = loop.evaluate(run, loader, len(loader), "on_test_batch_start", "Testing")

    module = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu", tta=0)
    images = data.normalize(data.test_dataset.images)
    dataset = torch.utils.data.TensorDataset(images, data.test_dataset.labels)
    shard = ContiguousShard(dataset, world, fabric.global_rank)  # unpadded: each image counted once
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    results = trainer.test(module, DataLoader(dataset, batch_size=64 // world or 1, sampler=shard), verbose=False)[0]
    if not trainer.is_global_zero:
        return None
    return {"loop": {f"test/{key}": scores[key] for key in ("top1", "top5", "loss")},
            "lightning": {k: float(v) for k, v in results.items()}}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "train":
        sys.exit(train(args))
    from zoo.explain.cli import main as eval_main

    code = eval_main(["--checkpoint", args[0], "--data-dir", args[1], "--max-test-images", args[2], "--cache-dir",
                      args[3], "--device", "cpu", "--batch-size", "64", "--out", str(RECORD / "eval")])
    if code:
        sys.exit(code)
    results = test(args[0], args[1], int(args[2]), args[3])
    if results is not None:
        (RECORD / "test.json").write_text(json.dumps(results))
