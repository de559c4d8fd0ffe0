"""Run directories and checkpoint files: ``runs/<model>/<run-id>/`` with config.yaml, metrics.csv,
checkpoints/{last,best}.ckpt and summary.json; atomic writes (temp file in the same folder, fsync,
``os.replace``) so a killed run never leaves a torn checkpoint; ``load_run`` rebuilds a trained model from a
run directory or a checkpoint without Lightning's Trainer; ``load_pretrained`` copies matching weights from
a zoo checkpoint or a timm state_dict, resampling the position embedding."""

from __future__ import annotations

import csv
import io
import json
import os
import secrets
import time
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from torch import nn

from .atomic import atomic_write

RUN_DIR_ENV = "ZOO_RUN_DIR"  # the run directory rank 0 chose, inherited by the processes DDP launches


def write_json(path: str | Path, data: dict) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(data, indent=2) + "\n").encode()))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO writes through an fsspec transaction whose temp file lives in the
    system temp dir and is moved (a copy across filesystems, no fsync): not atomic. This one is."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        atomic_write(path, lambda f: torch.save(checkpoint, f))


class _KeepingWriter(ExperimentWriter):
    """CSV writer that appends to an existing metrics.csv (Lightning's deletes it), dropping rows logged
    after the checkpoint a resumed run restarts from (they will be logged again)."""

    def __init__(self, log_dir: str, resume_step: int | None):
        self._resume_step = resume_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            keys, rows = list(reader.fieldnames or []), list(reader)
        if self._resume_step is not None:
            rows = [r for r in rows if r.get("step") and int(float(r["step"])) < self._resume_step]
        self.metrics_keys = keys
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write(path, lambda f: f.write(text.getvalue().encode()))


class ResumableCSVLogger(CSVLogger):
    """CSVLogger writing ``run_dir/metrics.csv`` (run_dir = OUT/<model>/<run-id>); a resumed run keeps the
    history logged before its checkpoint."""

    def __init__(self, run_dir: str | Path, resume_from: str | Path | None = None):
        run_dir = Path(run_dir)
        super().__init__(run_dir.parent.parent, name=run_dir.parent.name, version=run_dir.name)
        self._resume_step = checkpoint_step(resume_from) if resume_from else None

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._experiment = _KeepingWriter(self.log_dir, self._resume_step)
        return self._experiment


def checkpoint_step(path: str | Path) -> int:
    """The global step a Lightning checkpoint was saved at."""
    return int(_load_checkpoint(path).get("global_step", 0))


def new_run_id() -> str:
    """Timestamp plus a short random suffix, e.g. ``20250101-120000-3fa2``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def _latest_resumable(model_dir: Path) -> Path | None:
    """The newest run directory under ``model_dir`` holding checkpoints/last.ckpt."""
    runs = sorted((p for p in model_dir.glob("*/checkpoints/last.ckpt")), key=lambda p: p.stat().st_mtime)
    return runs[-1].parent.parent if runs else None


def prepare_run_dir(cfg: dict) -> tuple[Path, Path | None]:
    """Choose (and on rank 0 create) the run directory and the checkpoint to resume from.

    ``cfg["resume"]``: None -> a new run; ``"auto"`` -> the newest run of this model under ``cfg["out"]``
    with a last.ckpt (a new run if there is none); a run directory or a .ckpt path -> that run.
    Processes launched by DDP inherit the choice through the ``ZOO_RUN_DIR`` environment variable, so a
    DDP run leaves exactly one run directory."""
    out = Path(cfg["out"])
    model_dir = out / cfg["model"]
    inherited = os.environ.get(RUN_DIR_ENV) if os.environ.get("LOCAL_RANK", "0") != "0" else None
    resume = cfg["resume"]
    ckpt: Path | None = None
    if inherited:
        run_dir = Path(inherited)
        last = run_dir / "checkpoints" / "last.ckpt"
        ckpt = last if resume and last.is_file() else None
    elif resume == "auto":
        run_dir = _latest_resumable(model_dir)
        ckpt = run_dir / "checkpoints" / "last.ckpt" if run_dir else None
    elif resume:
        target = Path(resume)
        if target.is_dir():
            run_dir, ckpt = target, target / "checkpoints" / "last.ckpt"
        else:
            run_dir, ckpt = target.parent.parent, target
        if not ckpt.is_file():
            raise ValueError(f"--resume {resume}: no checkpoint at {ckpt}; pass a run directory holding "
                             "checkpoints/last.ckpt, a .ckpt file or 'auto'")
        _load_checkpoint(ckpt)  # a truncated / foreign file fails here with one line
    else:
        run_dir = None
    if run_dir is None:
        run_dir = model_dir / new_run_id()
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"cannot write the run directory {run_dir} (--out {out}): {err.strerror}") from None
    os.environ[RUN_DIR_ENV] = str(run_dir)
    from .config import dump
    if os.environ.get("LOCAL_RANK", "0") == "0":
        atomic_write(run_dir / "config.yaml", lambda f: f.write(dump(cfg).encode()))
    return run_dir, ckpt


def _load_checkpoint(path: str | Path) -> dict:
    """torch.load a Lightning checkpoint on CPU; missing / truncated / foreign -> ValueError (one line)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError / UnpicklingError / EOFError / zipfile errors
        raise ValueError(f"{path} is not a readable PyTorch checkpoint (truncated or corrupt?): "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path} holds a {type(ckpt).__name__}, not a checkpoint dict")
    return ckpt


def _zoo_checkpoint(path: Path) -> dict:
    ckpt = _load_checkpoint(path)
    hparams = ckpt.get("hyper_parameters", {})
    if "state_dict" not in ckpt or "model_name" not in hparams:
        raise ValueError(f"{path} is not a zoo training checkpoint (no state_dict / model_name)")
    return ckpt


def _model_state(ckpt: dict) -> dict[str, torch.Tensor]:
    """The wrapped model's weights from an ImageClassifier checkpoint (prefix ``model.`` stripped)."""
    return {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}


def load_run(path: str | Path) -> tuple[nn.Module, dict]:
    """``(model in eval mode on CPU, meta)`` from a run directory (best.ckpt preferred, else last.ckpt) or a
    .ckpt path. ``meta``: {"summary": summary.json or {}, "config": config.yaml or {}, "ckpt_path",
    "model_name", "model_args", "num_classes", "global_step", "epoch"}. Missing / truncated / foreign
    checkpoints -> ValueError."""
    import yaml

    from .models import create_model

    path = Path(path)
    if path.is_dir():
        ckpts = [path / "checkpoints" / name for name in ("best.ckpt", "last.ckpt")]
        ckpt_path = next((p for p in ckpts if p.is_file()), None)
        if ckpt_path is None:
            raise ValueError(f"{path} holds no checkpoints/best.ckpt or checkpoints/last.ckpt; expected a "
                             "run directory written by train.py or a .ckpt file")
        run_dir = path
    else:
        ckpt_path, run_dir = path, path.parent.parent
    ckpt = _zoo_checkpoint(ckpt_path)
    hp = ckpt["hyper_parameters"]
    model = create_model(hp["model_name"], num_classes=hp["num_classes"], **(hp.get("model_args") or {}))
    model.load_state_dict(_model_state(ckpt))
    model.eval()
    summary_file, config_file = run_dir / "summary.json", run_dir / "config.yaml"
    meta = {
        "summary": json.loads(summary_file.read_text()) if summary_file.is_file() else {},
        "config": yaml.safe_load(config_file.read_text()) if config_file.is_file() else {},
        "ckpt_path": str(ckpt_path), "model_name": hp["model_name"],
        "model_args": dict(hp.get("model_args") or {}),
        "num_classes": hp["num_classes"], "global_step": ckpt.get("global_step"), "epoch": ckpt.get("epoch"),
    }
    return model, meta


def load_pretrained(model: nn.Module, path: str | Path) -> list[str]:
    """Copy into ``model`` every weight of a zoo checkpoint or a timm ViT state_dict file whose name and
    shape match; a learned ``pos_embed`` of another grid is kept too, since the zoo ViT's load_state_dict
    resamples it (timm's resample_abs_pos_embed). Returns the names loaded; none matching -> ValueError."""
    ckpt = _load_checkpoint(path)
    if "state_dict" in ckpt and "hyper_parameters" in ckpt:
        source = _model_state(ckpt)
    else:
        source = ckpt.get("state_dict", ckpt.get("model", ckpt))
    target = model.state_dict()
    loaded = {k: v for k, v in source.items() if isinstance(v, torch.Tensor) and k in target
              and (v.shape == target[k].shape or k == "pos_embed")}
    if not loaded:
        raise ValueError(f"--init-from {path}: no weight matches the model by name and shape")
    model.load_state_dict(loaded, strict=False)
    return sorted(loaded)
