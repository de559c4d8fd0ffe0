"""The loggers of a run: metrics.csv always (``runs.ResumableCSVLogger``, which the zoo's reports read), plus any
of Lightning's loggers by name (``--logger tensorboard``, the recipe's ``loggers``), each writing into the run
directory where it writes files at all. ``require_loggers`` checks their packages are installed before any data
is read; this module imports Lightning only when it builds them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple


class LoggerSpec(NamedTuple):
    cls: str                    # the class in lightning.pytorch.loggers
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


def build_loggers(names: list[str], run_dir: Path, resume_from: Path | None) -> list:
    """metrics.csv's logger first (Lightning's ``trainer.logger``), then the loggers in ``names``: TensorBoard in
    run_dir/tensorboard/, W&B's files in run_dir (project "zoo"), MLflow's file store in run_dir/mlruns unless
    MLFLOW_TRACKING_URI points elsewhere, Comet (project "zoo")."""
    from lightning.pytorch import loggers

    from .runs import ResumableCSVLogger

    run_name = f"{run_dir.parent.name}/{run_dir.name}"   # <model>/<run-id>
    options = {
        "tensorboard": dict(save_dir=run_dir, name="tensorboard", version="", default_hp_metric=False),
        "wandb": dict(save_dir=run_dir, project="zoo", name=run_name),
        "mlflow": dict(experiment_name="zoo", run_name=run_name, save_dir=str(run_dir / "mlruns")),
        "comet": dict(project="zoo", name=run_name),
    }
    extra = [getattr(loggers, LOGGERS[name].cls)(**options[name]) for name in names if name != "csv"]
    return [ResumableCSVLogger(run_dir, resume_from=resume_from), *extra]
