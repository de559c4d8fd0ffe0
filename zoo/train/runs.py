"""Run directories and checkpoint files: ``runs/<model>/<run-id>/`` with config.yaml, metrics.csv,
checkpoints/{last,best}.ckpt and summary.json; which directory a command trains in (new, or the one it resumes,
checked against the recipe before anything is written) and the lock that keeps it to one process; checkpoints
written atomically (temp file in the same folder, fsync, ``os.replace``), so a killed run never leaves a torn one.
Reading weights back for evaluation (``load_run``, ``load_pretrained``) is ``zoo.models.checkpoints``."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from ..atomic import atomic_write, atomic_write_text, fcntl
from ..models.checkpoints import load_checkpoint
from ..models.run_files import read_summary
from ..runtime.distributed import is_global_zero
from .recipe import Recipe

RUN_DIR_ENV = "ZOO_RUN_DIR"  # the run directory rank 0 chose, inherited by the processes Fabric starts


def save_checkpoint(path: Path, state: dict) -> None:
    """``torch.save`` of ``state`` to ``path``, atomically: the previous file stays whole until the new one is."""
    atomic_write(path, lambda f: torch.save(state, f))


def load_training_checkpoint(path: Path) -> dict:
    """A checkpoint ``save_checkpoint`` wrote, for resuming or testing; one the zoo's loop did not write (an earlier
    zoo's, written by Lightning's Trainer) -> ValueError naming what it can still be used for."""
    checkpoint = load_checkpoint(path)
    if "loop" not in checkpoint:
        raise ValueError(f"{path} was written by an earlier zoo (Lightning's Trainer) and cannot be resumed; "
                         f"evaluate it with eval.py --checkpoint, or start a new run from its weights with "
                         f"--init-from {path}")
    return checkpoint


def checkpoint_step(path: str | Path) -> int:
    """The optimizer step a checkpoint was saved at."""
    return int(load_checkpoint(path).get("global_step", 0))


def new_run_id() -> str:
    """Timestamp plus a short random suffix, e.g. ``20250101-120000-3fa2``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def _latest_resumable(model_dir: Path) -> Path | None:
    """The newest run directory under ``model_dir`` holding checkpoints/last.ckpt."""
    runs = sorted((p for p in model_dir.glob("*/checkpoints/last.ckpt")), key=lambda p: p.stat().st_mtime)
    return runs[-1].parent.parent if runs else None


def find_run_dir(recipe: Recipe) -> tuple[Path, Path | None, bool]:
    """``(run directory, checkpoint to resume or None, whether the directory is new)``; writes nothing.

    ``recipe.resume``: None -> a new run; ``"auto"`` -> the newest run of this model under ``recipe.out``
    with a last.ckpt (a new run if there is none); a run directory or a .ckpt path -> that run, whose
    checkpoint must be a zoo checkpoint of the recipe's model and model arguments (``check_resume``).
    Processes Fabric starts (several devices, no launcher) inherit the choice through ``RUN_DIR_ENV``;
    under torchrun or SLURM ``fit`` calls this on rank 0 only and broadcasts the answer, so a DDP run leaves exactly
    one run directory."""
    model_dir = Path(recipe.out) / recipe.model
    resume = recipe.resume
    if os.environ.get(RUN_DIR_ENV) and os.environ.get("LOCAL_RANK", "0") != "0":
        run_dir = Path(os.environ[RUN_DIR_ENV])
        last = run_dir / "checkpoints" / "last.ckpt"
        return run_dir, last if resume and last.is_file() else None, False
    if resume == "auto":
        run_dir = _latest_resumable(model_dir)
        if run_dir is None:
            print(f"--resume auto: no run of {recipe.model} under {recipe.out} has a checkpoints/last.ckpt; "
                  "starting a new run")
            return model_dir / new_run_id(), None, True
        ckpt = run_dir / "checkpoints" / "last.ckpt"
    elif resume:
        target = Path(resume)
        run_dir, ckpt = (target, target / "checkpoints" / "last.ckpt") if target.is_dir() else (
            target.parent.parent, target)
        if not ckpt.is_file():
            raise ValueError(f"--resume {resume}: no checkpoint at {ckpt}; pass a run directory holding "
                             "checkpoints/last.ckpt, a .ckpt file or 'auto'")
    else:
        return model_dir / new_run_id(), None, True
    check_resume(recipe, ckpt)
    if ckpt.parent.name != "checkpoints":  # a run directory holds it in checkpoints/: any other folder is not one
        raise ValueError(f"--resume {resume}: a checkpoint outside a run directory's checkpoints/ folder; pass "
                         f"its run directory, or start a new run from its weights with --init-from {resume}")
    check_resume_recipe(recipe, run_dir)
    return run_dir, ckpt, False


# what a resumed run may change: its length (epochs, max_time), where it runs (accelerator, devices, strategy,
# num_nodes, compile, data_memory_budget), where its data is read from (data_dir, cache_dir, download: the classes are
# checked), what it writes beside its metrics (out, loggers, checkpoint intervals), the command's action (resume, and
# init_from / init_partial, which only a new run uses) and the evaluation batch; precision and muon_dtype "auto" keep
# what the run chose (config.yaml records it)
RESUMABLE_CHANGES = frozenset({
    "epochs", "max_time", "accelerator", "devices", "strategy", "num_nodes", "compile", "data_memory_budget",
    "data_dir", "cache_dir", "download", "out", "loggers", "ckpt_every_n_steps", "ckpt_every_minutes", "resume",
    "init_from", "init_partial", "eval_batch_size"})


def _flat(recipe: dict) -> dict:
    """A recipe mapping with its sections' keys dotted (``augment.cutout``); model_args left out (``check_resume``
    compares them with the checkpoint's)."""
    flat = {}
    for key, value in recipe.items():
        if key == "augment" and isinstance(value, dict):
            flat.update({f"augment.{k}": v for k, v in value.items()})
        elif key != "model_args":
            flat[key] = value
    return flat


def check_resume_recipe(recipe: Recipe, run_dir: Path) -> None:
    """A resumed run trains on with the recipe its config.yaml records: a setting that differs from it (a new
    --lr, --batch-size, --set label_smoothing=...) -> ValueError naming each, except ``RESUMABLE_CHANGES``. A run
    without a readable config.yaml is not checked."""
    from .recipe import parse_yaml

    path = run_dir / "config.yaml"
    try:
        recorded = parse_yaml(path.read_text(), str(path))
    except (OSError, ValueError):
        return
    if not isinstance(recorded, dict):
        return
    saved, wanted = _flat(recorded), _flat(parse_yaml(recipe.to_yaml(), "the recipe"))
    keeps_choice = {"precision": recipe.precision == "auto", "muon_dtype": recipe.muon_dtype == "auto"}
    changed = [key for key, value in wanted.items() if key in saved and saved[key] != value
               and key not in RESUMABLE_CHANGES and not keeps_choice.get(key, False)]
    if changed:
        diff = ", ".join(f"{key}: {saved[key]!r} in the run, {wanted[key]!r} now" for key in changed)
        raise ValueError(f"--resume {run_dir}: the recipe differs from the run's config.yaml ({diff}); resume with "
                         f"the run's recipe (--config {path} --resume {run_dir}) or start a new run")


def check_resume(recipe: Recipe, ckpt: Path) -> dict:
    """The checkpoint's hyper_parameters, after checking that it is a zoo training checkpoint of
    ``recipe.model`` with the recipe's model arguments and image size, saved at most ``recipe.epochs`` epochs in;
    else ValueError (one line)."""
    checkpoint = load_checkpoint(ckpt)
    hp = checkpoint.get("hyper_parameters") or {}
    if "model_name" not in hp:
        raise ValueError(f"--resume {ckpt}: not a zoo training checkpoint (no hyper_parameters.model_name)")
    if "loop" not in checkpoint:  # the weights still serve: evaluation, --init-from
        load_training_checkpoint(ckpt)
    if hp["model_name"] != recipe.model:
        raise ValueError(f"--resume {ckpt}: that run trains {hp['model_name']}, not --model {recipe.model}; "
                         f"resume it with --model {hp['model_name']} or start a new run")
    done = checkpoint.get("epoch") or 0  # the epochs finished when it was saved
    if done > recipe.epochs:
        raise ValueError(f"--resume {ckpt}: the run is {done} epochs in, past --epochs {recipe.epochs}; resume with "
                         f"--epochs {done} or more (its config.yaml), or start a new run")
    saved, wanted = dict(hp.get("model_args") or {}), {**recipe.model_args, "img_size": recipe.img_size}
    if saved != wanted:
        def shown(args: dict, key: str) -> str:
            return repr(args[key]) if key in args else "unset"

        diff = ", ".join(f"{k}: {shown(saved, k)} in the run, {shown(wanted, k)} now"
                         for k in sorted(set(saved) | set(wanted)) if saved.get(k, ...) != wanted.get(k, ...))
        raise ValueError(f"--resume {ckpt}: the model arguments differ from the run's ({diff}); resume with the "
                         "run's recipe (its config.yaml) or start a new run")
    return hp


def check_resume_data(ckpt: Path, num_classes: int, class_names: list[str]) -> None:
    """The data of a resumed run must have the run's classes: its checkpoint's num_classes and, where its
    summary.json records them, its class names in order; else ValueError."""
    hp = load_checkpoint(ckpt)["hyper_parameters"]
    if hp.get("num_classes") != num_classes:
        raise ValueError(f"--resume {ckpt}: the run has {hp.get('num_classes')} classes, the data has "
                         f"{num_classes}; resume on the run's data (its config.yaml data_dir)")
    summary = ckpt.parent.parent / "summary.json"
    recorded = read_summary(summary).get("class_names") if summary.is_file() else None
    if recorded is not None and list(recorded) != list(class_names):
        raise ValueError(f"--resume {ckpt}: the data's classes {list(class_names)} are not the run's "
                         f"{list(recorded)}")


def check_resume_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """The checkpoint's weights must fit ``model`` (the recipe's model for the data's classes): a tensor of another
    shape (a checkpoint written by other code, or edited) -> ValueError naming it, instead of a traceback from
    Lightning once the run directory is being written."""
    saved = load_checkpoint(ckpt).get("state_dict") or {}
    wrong = [(key, tuple(saved[f"model.{key}"].shape), tuple(value.shape)) for key, value in model.state_dict().items()
             if isinstance(saved.get(f"model.{key}"), torch.Tensor) and saved[f"model.{key}"].shape != value.shape]
    if wrong:
        shown = ", ".join(f"{key} {list(have)} in the checkpoint, {list(want)} in the model" for key, have, want in
                          wrong[:3])
        raise ValueError(f"--resume {ckpt}: its weights do not fit the model ({shown}"
                         f"{f' and {len(wrong) - 3} more' if len(wrong) > 3 else ''}); resume a checkpoint the run "
                         "wrote, or start a new run")


LOCK_FILE = "run.lock"


class RunLock:
    """Holds a run directory for one process (``fcntl.flock`` on ``run_dir/run.lock``, which holds the holder's
    pid while it runs and is empty after): a second process that tries to take it -> ValueError naming the
    holder. The kernel drops the lock when its process dies, so the lock of a killed run is taken over (with one
    line saying so). ``release`` (or the
    process's end) gives it back; a lock this process still holds from an earlier ``fit`` that failed is given
    back when it takes the directory again. Without ``fcntl`` (Windows) nothing is locked."""

    _held: dict[Path, RunLock] = {}  # this process's locks, by path

    def __init__(self, run_dir: Path):
        self.path = (Path(run_dir) / LOCK_FILE).absolute()
        self._file = None

    def acquire(self) -> RunLock:
        if fcntl is None:
            return self
        if self.path in RunLock._held:
            RunLock._held[self.path].release()
        try:
            self._file = open(self.path, "a+")
        except OSError as err:  # a run directory on a read-only mount, or not this user's
            raise ValueError(f"cannot write the run directory {self.path.parent}: {err.strerror}; copy the run "
                             "to a writable folder to resume it") from None
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = self._holder()
            self._file.close()
            self._file = None
            raise ValueError(f"run directory {self.path.parent} is in use by another train.py (process "
                             f"{holder or 'unknown'}); wait for it to end or stop it, then resume") from None
        stale = self._holder()
        if stale and stale != str(os.getpid()):
            print(f"run directory {self.path.parent}: taking over the lock of process {stale}, which has ended")
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()
        RunLock._held[self.path] = self
        return self

    def _holder(self) -> str:
        self._file.seek(0)
        return self._file.read().strip()

    def release(self) -> None:
        if self._file is not None:
            RunLock._held.pop(self.path, None)
            self._file.truncate(0)  # emptied, not removed: removing it would let two processes lock two files
            self._file.close()  # closing drops the flock
            self._file = None


def create_run_dir(recipe: Recipe, run_dir: Path) -> Path | None:
    """Create ``run_dir/checkpoints`` with config.yaml and return the topmost folder this call created (None if the
    run directory existed), for ``remove_failed_run``; unwritable -> ValueError. Rank 0's job: the processes
    Lightning launches next find the directory in ``ZOO_RUN_DIR``, and write nothing here."""
    if not is_global_zero():
        return None
    created = next((p for p in reversed([run_dir, *run_dir.parents]) if not p.exists()), None)
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"cannot write the run directory {run_dir} (--out {recipe.out}): {err.strerror}") from None
    os.environ[RUN_DIR_ENV] = str(run_dir)
    recorded = replace(recipe, resume=None)  # the recipe, not this command's action: rerunning it starts a new run
    atomic_write_text(run_dir / "config.yaml", recorded.to_yaml())
    return created


def recorded_choice(run_dir: Path, key: str, default: str, accelerator: str) -> str:
    """What a run's config.yaml records under ``key`` (``fit`` writes what ``auto`` and the probes resolved to:
    precision, muon_dtype, optimizer), or ``default`` when it records none or no valid one, cannot be read, or
    records fp16 AMP and the run now resumes on a CPU (Lightning has none there; a GPU and MPS have)."""
    try:
        recorded = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get(key)
        Recipe.from_dict({key: recorded})  # the recipe's own check of the value
    except (OSError, yaml.YAMLError, AttributeError, ValueError):
        return default
    if recorded is None or key == "precision" and str(recorded) == "16-mixed" and accelerator == "cpu":
        return default
    return str(recorded)


def remove_failed_run(run_dir: Path, created: Path | None) -> None:
    """After a new run failed: remove its directory (and the empty folders above it this run created) unless a
    checkpoint of at least one optimizer step was written, so a failed train.py leaves no empty run behind."""
    last = run_dir / "checkpoints" / "last.ckpt"
    if created is None or (last.is_file() and checkpoint_step(last) > 0):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for folder in run_dir.parents:
        if folder == created.parent:
            break
        try:
            folder.rmdir()  # only when empty
        except OSError:
            break
