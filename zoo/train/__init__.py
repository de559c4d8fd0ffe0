"""Training: the typed recipe (``recipe``, its value checks in ``checks`` and train.py's flags in ``cli``), the loop
on Lightning Fabric (``loop``: ``fit``, one resumable run, and its clock, progress, metrics, checkpoints, run
directories and signal handling in ``clock``, ``progress``, ``metrics``, ``runs`` and ``preemption``), the steps it
shares with the LightningModule (``step``; ``module.ImageClassifier`` for users who bring a ``lightning.Trainer``),
the optimizers, schedule and EMA (``optim``, ``compiled``), and what a run measures before it trains (``probes``).
Imports ``zoo.data``, ``zoo.runtime``, ``zoo.models`` and ``zoo.layers``, never ``zoo.explain`` or ``zoo.bench``;
Lightning loads only with the loop or the LightningModule."""

from importlib import import_module

_LAZY = {"ImageClassifier": "zoo.train.module", "fit": "zoo.train.loop", "resolve_config": "zoo.train.recipe",
         "Recipe": "zoo.train.recipe"}

__all__ = ["ImageClassifier", "Recipe", "fit", "resolve_config"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
