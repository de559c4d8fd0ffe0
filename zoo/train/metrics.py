"""What a run logs: ``metrics.csv`` (``MetricsFile``: one row a logging step, an epoch's end or the test, in the
columns ``COLUMNS``; the file the zoo's reports read, kept across resumes), and any of Lightning's loggers beside it
by name (``--logger tensorboard``, the recipe's ``loggers``), which Fabric hands the same rows.

metrics.csv exists from the run's start and is appended to, a row at a time, and flushed to disk at every
checkpoint; a resumed run's first row replaces, in one atomic rewrite, the rows logged after its checkpoint (and a
row cut short by a kill), so a stopped and resumed run's file equals the uninterrupted one's. A resume that fails,
or of a finished run with nothing to train, leaves the file as it was."""

from __future__ import annotations

import csv
import importlib.util
import os
from pathlib import Path
from typing import NamedTuple

from ..atomic import atomic_write_csv
from ..models.run_files import read_metrics

# a step's row: epoch, step, lr, train/loss_step; an epoch's row: the training epoch's and the validation's scores
# and the run's wall seconds so far; the test's row: test/*
COLUMNS = ("epoch", "step", "lr", "train/loss_step", "train/loss_epoch", "train/top1", "train/top5", "val/loss",
           "val/top1", "val/top5", "time/elapsed_s", "test/loss", "test/top1", "test/top5")


class MetricsFile:
    """``run_dir/metrics.csv``, written by rank 0. ``resume_step``: the step of the checkpoint a resumed run
    continues (None for a new run); rows after it, and the test's row at it, are left out when the first new
    row is written."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path, self.resume_step = Path(path), resume_step
        self._file = None
        if resume_step is None or not self.path.is_file():  # a new run's file holds its header from the start
            atomic_write_csv(self.path, list(COLUMNS), [])

    def _kept(self, row: dict) -> bool:
        if not row.get("step"):
            return False
        step = int(float(row["step"]))
        return step < self.resume_step or step == self.resume_step and not row.get("test/top1")

    def log(self, row: dict) -> None:
        """Append ``row`` (keys among ``COLUMNS``)."""
        if self._file is None:
            if self.resume_step is not None:  # the rows the resumed run logs again go, in one atomic rewrite
                keys, rows = read_metrics(self.path)
                kept = [{k: v for k, v in r.items() if k in COLUMNS} for r in rows if self._kept(r)]
                atomic_write_csv(self.path, list(COLUMNS), kept)
                self.resume_step = None
            self._file = self.path.open("a", newline="")
        csv.DictWriter(self._file, fieldnames=COLUMNS).writerow({key: _cell(value) for key, value in row.items()})
        self._file.flush()

    def sync(self) -> None:
        """The rows so far on disk (at every checkpoint: the history up to it survives a kill)."""
        if self._file is not None:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _cell(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class LoggerSpec(NamedTuple):
    cls: str                    # the class in lightning.fabric.loggers / lightning.pytorch.loggers
    modules: tuple[str, ...]    # any one of these importable is enough
    pip: str                    # the package that provides it


LOGGERS = {
    "csv": LoggerSpec("CSVLogger", ("lightning",), "lightning"),   # always on: metrics.csv
    "tensorboard": LoggerSpec("TensorBoardLogger", ("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": LoggerSpec("WandbLogger", ("wandb",), "wandb"),
    "mlflow": LoggerSpec("MLFlowLogger", ("mlflow",), "mlflow"),
    "comet": LoggerSpec("CometLogger", ("comet_ml",), "comet-ml"),
}


def logger_names(key: str, value) -> list[str]:
    """Logger names: a list, each item possibly comma-separated (``--logger tensorboard,wandb``), normalised to
    the loggers beside metrics.csv, in order, each once."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
        raise ValueError(f"{key} must be a list of logger names ({', '.join(LOGGERS)}), got {value!r}")
    names = [name.strip().lower() for item in items for name in item.split(",") if name.strip()]
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise ValueError(f"{key}: unknown logger {', '.join(unknown)}; expected among {', '.join(LOGGERS)}")
    return list(dict.fromkeys(name for name in names if name != "csv"))   # metrics.csv is always written


def require_loggers(names: list[str]) -> None:
    """A logger in ``names`` whose package is not installed -> ValueError naming the pip command."""
    for name in names:
        spec = LOGGERS[name]
        if not any(importlib.util.find_spec(module) for module in spec.modules):
            raise ValueError(f"--logger {name} needs the {spec.pip} package, which is not installed: "
                             f"pip install {spec.pip}")


def build_loggers(names: list[str], run_dir: Path) -> list:
    """Lightning's loggers of ``names`` for Fabric: TensorBoard in run_dir/tensorboard/ (Fabric's), W&B's files
    in run_dir (project "zoo"), MLflow's file store in run_dir/mlruns unless MLFLOW_TRACKING_URI points
    elsewhere, Comet (project "zoo")."""
    if not names:
        return []
    from lightning.fabric import loggers as fabric_loggers
    from lightning.pytorch import loggers

    run_name = f"{run_dir.parent.name}/{run_dir.name}"   # <model>/<run-id>
    built = []
    for name in names:
        if name == "tensorboard":
            built.append(fabric_loggers.TensorBoardLogger(root_dir=run_dir, name="tensorboard", version="",
                                                          default_hp_metric=False))
        elif name == "wandb":
            built.append(loggers.WandbLogger(save_dir=run_dir, project="zoo", name=run_name))
        elif name == "mlflow":
            built.append(loggers.MLFlowLogger(experiment_name="zoo", run_name=run_name,
                                              save_dir=str(run_dir / "mlruns")))
        elif name == "comet":
            built.append(loggers.CometLogger(project="zoo", name=run_name))
    return built
