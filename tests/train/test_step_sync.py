"""A training step makes no host sync (DESIGN's hardware contract), proven on the CPU with a dispatch mode.

train.py's loop trains a tiny ViT on a small ImageFolder tree through the real data path (the uint8 tensor
dataset, the batched augmentation, the shared step, the optimizer, the EMA), deciding every ``EVERY`` steps as on
a GPU (``host_sync_every``). ``StepSyncs`` records every aten op from the end of one training step to the end of
the next: the decisions and checkpoints of the first, then the next batch's indexing, augmentation, forward,
backward, optimizer step, EMA and counts. Measured: the windows after ``WARMUP`` steps that hold no logging step
(metrics.csv's rows read the loss on the host, one sync per logging step, which is allowed; the progress line
reads it at its own refresh rate likewise, and is left off here) and no decision step. In those windows the test
fails on

- a read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``nonzero`` ...: OpRecorder's
  ``SYNC_OPS``; indexing with a boolean mask, whose kernel calls nonzero) or a device-to-host copy;
- tensors built from Python data (``torch.tensor(value, device=...)``, a blocking copy on a GPU) that meet device
  data, beyond the one per batch the sampler's index list needs (copied from pinned memory without blocking).

On the CPU the host and the device are one, so the recorder tells them apart by where a tensor comes from.
Host values: tensors made inside the window from nothing but host data (a factory op, ``torch.tensor``), the
tensors that stay on the CPU in a GPU run too (torchvision's MixUp / CutMix / RandomChoice parameters, the step
counts torch's non-fused optimizers keep there), and whatever is computed from host values alone; torchvision
draws its random choices that way. Everything else (the model, the optimizer state, the dataset, the batch and
all computed from them) is device data. One CPU-only read is excused by name: ``F.one_hot(labels, num_classes)``
checks the label range with ``.item()`` on the CPU, and on CUDA leaves that to a device-side assert."""

from __future__ import annotations

import functools
import linecache
import traceback
import weakref

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import MixedPrecision
from torch.utils._pytree import tree_flatten

from zoo.bench.dispatch import SYNC_OPS, OpCall, OpRecorder
from zoo.data.randaugment import RandAugment
from zoo.train import loop
from zoo.train.progress import Progress

WARMUP, MEASURED, LOG_EVERY, EVERY = 3, 4, 8, 100  # steps 4-7 are measured; a row (and last.ckpt) after step 8


class StepSyncs(OpRecorder):
    """``OpRecorder`` that also keeps ``device_syncs`` (OpRecorder's sync ops and boolean-mask indexing when they
    read device data, and device-to-host copies) and ``uploads`` (tensors built from Python data that meet
    device data), telling host values from device data as the module docstring says. ``host_tensors``: the
    tensors that existed before and are host values."""

    def __init__(self, host_tensors=()):
        super().__init__()
        self.host: dict[int, weakref.ref] = {}  # id -> tensor, for the tensors computed from host data alone
        self.host.update((id(t), weakref.ref(t)) for t in host_tensors)
        self.data: dict[int, weakref.ref] = {}  # the host tensors built from Python data, and their results
        self.uploaded: set[int] = set()
        self.device_syncs: list[OpCall] = []
        self.sync_sites: list[str] = []  # where each device sync was called from

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self.host.get(id(t))
        return ref is not None and ref() is t  # not a newer tensor at a freed one's address

    def _is_data(self, t: torch.Tensor) -> bool:
        ref = self.data.get(id(t))
        return ref is not None and ref() is t

    @property
    def uploads(self) -> int:
        """How many tensors built from Python data (and computed from such alone) met device data."""
        return len(self.uploaded)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        made_from_data = name in ("lift_fresh", "lift_fresh_copy")  # torch.tensor(python_value)
        from_host = made_from_data or all(self._is_host(t) for t in inputs)  # factory ops (no input) too
        if from_host:
            self.host.update((id(t), weakref.ref(t)) for t in outputs)
        else:  # a host tensor written in place by device data holds device data (GradScaler's inf flag)
            for t in _written(func, args, kwargs):
                self.host.pop(id(t), None)
        if made_from_data or (from_host and any(self._is_data(t) for t in inputs)):
            self.data.update((id(t), weakref.ref(t)) for t in outputs)
        elif not from_host:  # device data meets host data: on a GPU that host tensor was copied to the device
            self.uploaded.update(id(t) for t in inputs if self._is_data(t))
        call = OpCall(name, tuple(t.dtype for t in (*inputs, *outputs)),
                      tuple(t.device.type for t in (*inputs, *outputs)))
        self.calls.append(call)
        # indexing with a boolean mask (x[mask], x[mask] = v) runs nonzero inside the kernel, out of this mode's sight
        masked_index = name.startswith("index") and any(
            t.dtype == torch.bool and not self._is_host(t) for t in tree_flatten(args[1:2])[0]
            if isinstance(t, torch.Tensor))
        sync = (name in SYNC_OPS or masked_index) and not from_host
        if (sync or call.copies_to_host) and not _in_cpu_only_one_hot_check():
            self.device_syncs.append(call)
            self.sync_sites.append(_caller())
        return out


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place or into (its schema's mutable arguments)."""
    schema = func._schema.arguments
    named = dict(zip((a.name for a in schema), args, strict=False)) | kwargs  # positional, then keyword
    written = [named.get(a.name) for a in schema if a.alias_info is not None and a.alias_info.is_write]
    return [t for t in tree_flatten(written)[0] if isinstance(t, torch.Tensor)]


def _caller() -> str:
    """file:line of the innermost Python frames outside torch (for the failure message)."""
    frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and f.filename != __file__]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(frames[-3:]))


def _in_cpu_only_one_hot_check() -> bool:
    """Whether the innermost Python frame outside torch's dispatch machinery is a ``one_hot(`` call."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return "one_hot(" in linecache.getline(frame.filename, frame.lineno)
    return False


def host_tensors(run) -> list[torch.Tensor]:
    """The tensors a GPU run keeps on the CPU: torchvision's transform state (MixUp / CutMix's Beta
    distribution), and the step counts of optimizer groups that are neither fused nor capturable (torch.optim
    keeps those on the CPU)."""
    found = []
    for transform in (run.data._augment.mix, run.data._augment.randaugment):
        found += _tensors_in(transform)
    optimizer = run.optimizer
    for group in optimizer.param_groups:
        if not (group.get("fused") or group.get("capturable")):
            found += [optimizer.state[p]["step"] for p in group["params"] if "step" in optimizer.state[p]]
    return found


def _tensors_in(obj, depth: int = 4) -> list[torch.Tensor]:
    """Tensors among the attributes of ``obj`` and of the objects (modules, distributions) they hold."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0 or not hasattr(obj, "__dict__"):
        return []
    values = list(vars(obj).values())
    values += [v for value in values if isinstance(value, (list, tuple, dict)) for v in
               (value.values() if isinstance(value, dict) else value)]
    return [t for value in values for t in _tensors_in(value, depth - 1)]


class MeasureWindows:
    """Records each window from the end of step ``WARMUP + i`` to the end of the next, with whether the loop logged a
    row in it."""

    def __init__(self):
        self.windows: list[tuple[StepSyncs, bool]] = []
        self.rows = 0
        self._open: StepSyncs | None = None
        self._rows_before = 0

    def on_train_batch_end(self, run):
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self.windows.append((self._open, self.rows > self._rows_before))
            self._open = None
        if WARMUP <= run.position.step < WARMUP + MEASURED:
            self._rows_before = self.rows
            self._open = StepSyncs(host_tensors(run))
            self._open.__enter__()


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory, image_tree_writer):
    """train/ and test/ ImageFolder trees of random 16 x 16 PNGs, 10 classes."""
    return image_tree_writer(tmp_path_factory.mktemp("tree"), 16)


RECIPES = {
    "plain": [],
    "ema": ["--set", "ema_decay=0.9"],
    "sgd_label_smoothing": ["--set", "optimizer=sgd", "--set", "label_smoothing=0.1"],
    "muon": ["--set", "optimizer=muon"],
    "muon_16_mixed": ["--set", "optimizer=muon", "fp16"],
    "alternating_flip": ["--set", "augment.alternating_flip=true"],
    "mixup": ["--set", "augment.mixup_alpha=0.8"],
    "cutmix": ["--set", "augment.cutmix_alpha=1.0"],
    "mixup_cutmix_cutout": ["--set", "augment.mixup_alpha=0.8", "--set", "augment.cutmix_alpha=1.0", "--set",
                            "augment.cutout=4", "--set", "ema_decay=0.9"],
    "randaugment": ["--set", "augment.randaugment={num_ops: 2, magnitude: 9}"],
}


def measured_windows(run_train, image_tree, tmp_path, monkeypatch, options: list, every: int = EVERY
                     ) -> list[StepSyncs]:
    """Train the tiny ViT for ``WARMUP + MEASURED + 1`` steps and return the recorded windows without a logging
    step; the decisions every ``every`` steps."""
    windows = MeasureWindows()
    real_log = loop.log

    def counted(run, row):
        windows.rows += 1
        real_log(run, row)

    def fabric_for(plan, callbacks):  # fp16 autocast with a GradScaler, as on a GPU (Fabric has none on a CPU)
        fp16 = [MixedPrecision("16-mixed", "cpu")] if "fp16" in options else []
        return Fabric(accelerator="cpu", devices=1, callbacks=[*callbacks], plugins=fp16,
                      **({} if fp16 else {"precision": "32-true"}))

    monkeypatch.setattr(loop, "log", counted)
    monkeypatch.setattr(loop, "host_sync_every", lambda device_type: every)
    monkeypatch.setattr(loop, "make_fabric", fabric_for)
    monkeypatch.setattr(loop, "fit", functools.partial(loop.fit, callbacks=[windows]))
    monkeypatch.setattr(Progress, "due", lambda self, step: False)  # the progress line's own read, as logging's
    done = run_train(["--model", "vit_nano", "--data-dir", image_tree, "--img-size", "16", "--batch-size", "8",
                      "--set", "val_size=8", "--set", "label_smoothing=0", "--precision", "32", "--epochs", "1",
                      "--limit-train-batches", str(WARMUP + MEASURED + 1), "--limit-val-batches", "1",
                      "--limit-test-batches", "1", "--ckpt-every-n-steps", str(LOG_EVERY), "--ckpt-every-minutes",
                      "0", "--set", "model_args.embed_dim=32", "--set", "model_args.depth=1", "--set",
                      "model_args.num_heads=2", "--out", tmp_path / "runs", "--cache-dir", tmp_path / "cache",
                      *[o for o in options if o != "fp16"]])
    assert done.returncode == 0, done.stderr[-2000:]
    measured = [window for window, logged in windows.windows if not logged]
    assert len(windows.windows) == MEASURED and len(measured) == MEASURED
    for window in measured:
        assert any(c.name in ("addmm", "mm", "bmm") for c in window.compute)  # a whole step was recorded
    return measured


@pytest.mark.parametrize("options", RECIPES.values(), ids=list(RECIPES))
def test_training_steps_between_logging_steps_make_no_host_sync(options, run_train, image_tree, tmp_path,
                                                                monkeypatch):
    # RandAugment reads its draws on the host on a CPU alone (where that costs nothing): the path of every device
    monkeypatch.setattr(RandAugment, "grouped_on_cpu", False)
    monkeypatch.setattr(loop, "FUSED_OPTIMIZER_DEVICES", ("cpu",))  # the optimizers a GPU run builds
    for window in measured_windows(run_train, image_tree, tmp_path, monkeypatch, options):
        syncs = [f"{c.name} at {site}" for c, site in zip(window.device_syncs, window.sync_sites, strict=True)]
        assert syncs == []
        assert window.uploads <= 1, f"{window.uploads} tensors built from Python data met device data in one step"


def test_the_recorder_sees_the_nan_checks_read_of_the_device_flag(run_train, image_tree, tmp_path, monkeypatch):
    """The NaN check reads the flag on the host once per decision: deciding at every step (as on a CPU), each
    window has that one sync and no other, so the recorder does see a read made by the loop."""
    for window in measured_windows(run_train, image_tree, tmp_path, monkeypatch, [], every=1):
        assert [c.name for c in window.device_syncs] == ["_local_scalar_dense"]
        assert "loop.py" in window.sync_sites[0]
