"""Reading torchvision's CIFAR-10 python batches (``cifar-10-batches-py``: data_batch_1..5, test_batch and
batches.meta; https://www.cs.toronto.edu/~kriz/cifar.html) without running code. The files are pickles, and
``pickle.load`` calls whatever a pickle names, so a folder from a mirror or an archive could run anything on
opening. ``BatchUnpickler`` builds only what the format holds (dicts, lists, str / bytes, numbers and numpy
arrays with their dtypes) and refuses every other name; each file's format is then checked before use: the
keys, ``data`` uint8 of shape (N, 3072), one int label per row, labels indexing ``label_names``. Every
problem is a ``DataError`` (a ``ValueError``) whose one line names the file."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from .layout import CIFAR_META, CIFAR_TEST, CIFAR_TRAIN, SPLITS, DataError

ROW_BYTES = 3 * 32 * 32  # one image a row: the red, green and blue 32x32 planes


class _Latin1Encode:
    """``_codecs.encode(text, "latin1")``: how a protocol-2 pickle written by Python 3 stores ``bytes``
    (latin-1 only; slotted, so a pickle's BUILD cannot set attributes on it)."""

    __slots__ = ()

    def __call__(self, text, encoding="latin1"):
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise pickle.UnpicklingError(f"_codecs.encode is read for latin-1 text only, got {encoding!r}")
        return text.encode("latin1")


_RECONSTRUCT = np.zeros(1).__reduce__()[0]  # numpy's array reconstructor, wherever this numpy keeps it
ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,   # the name numpy 1.x (and CIFAR's files) use
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,  # numpy 2.x
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _Latin1Encode(),
}


class BatchUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the names in ``ALLOWED``; any other (``os.system``, ``builtins.eval``,
    a class with ``__reduce__``) -> ``pickle.UnpicklingError`` before anything is called."""

    def find_class(self, module: str, name: str):
        try:
            return ALLOWED[module, name]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which CIFAR-10 batches never hold (a pickle "
                                         "may run code; only dicts, lists, str, bytes, numbers and numpy arrays "
                                         "are read)") from None


def load_batch_file(path: Path) -> dict:
    """One CIFAR-10 batch file as a dict with str keys (bytes keys decoded as latin-1), unpickled by
    ``BatchUnpickler`` as torchvision does (``encoding="latin1"``); a file that is not such a pickle ->
    DataError naming it."""
    try:
        with open(path, "rb") as f:
            content = BatchUnpickler(f, encoding="latin1").load()
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None
    except Exception as err:  # a damaged pickle fails in many ways (EOFError, TypeError, ValueError, ...)
        reason = " ".join(str(err).split())
        raise DataError(f"refused to read {path}: not a CIFAR-10 python batch ({type(err).__name__}: "
                        f"{reason})") from None
    if not isinstance(content, dict):
        raise _format_error(path, f"it holds a {type(content).__name__}, not a dict")
    return {_text(key): value for key, value in content.items()}


def read_label_names(folder: Path) -> list[str]:
    """The class names in ``folder/batches.meta`` (``label_names``: distinct non-empty strings)."""
    path = folder / CIFAR_META
    names = load_batch_file(path).get("label_names")
    if not isinstance(names, list) or not names or not all(isinstance(n, (str, bytes)) and n for n in names):
        raise _format_error(path, f"label_names must be a list of class names, got {_shown(names)}")
    names = [_text(n) for n in names]
    if len(set(names)) != len(names):
        raise _format_error(path, f"label_names repeats a name: {names}")
    return names


def read_batch(path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One data / test batch as uint8 (N, 3072) rows and int64 (N,) labels in ``0..num_classes - 1``."""
    batch = load_batch_file(path)
    missing = [key for key in ("data", "labels") if key not in batch]
    if missing:
        raise _format_error(path, f"it lacks the key(s) {', '.join(missing)} (has {sorted(map(str, batch))})")
    data, labels = batch["data"], batch["labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != ROW_BYTES:
        shape = f"{data.dtype} {tuple(data.shape)}" if isinstance(data, np.ndarray) else type(data).__name__
        raise _format_error(path, f"data must be uint8 of shape (N, {ROW_BYTES}), got {shape}")
    if len(data) == 0:
        raise _format_error(path, "it holds no images")
    if not isinstance(labels, list) or not all(isinstance(y, int) and not isinstance(y, bool) for y in labels):
        raise _format_error(path, f"labels must be a list of ints, got {_shown(labels)}")
    if len(labels) != len(data):
        raise _format_error(path, f"{len(labels)} labels for {len(data)} images")
    outside = [y for y in labels if not 0 <= y < num_classes]  # Python ints: 2**70 is checked, not overflowed
    if outside:
        raise _format_error(path, f"labels must lie in 0..{num_classes - 1} (the {num_classes} label_names of "
                                  f"{CIFAR_META}), got {_shown(outside[0])}")
    return data, np.asarray(labels, dtype=np.int64)


def batch_files(folder: Path) -> list[Path]:
    """The seven files of a CIFAR-10 batch folder; one missing -> DataError naming it."""
    paths = [folder / name for name in (CIFAR_META, *CIFAR_TRAIN, *CIFAR_TEST)]
    absent = [path.name for path in paths if not path.is_file()]
    if absent:
        raise DataError(f"{folder} lacks {', '.join(absent)}: CIFAR-10 python batches are data_batch_1..5, "
                        f"test_batch and {CIFAR_META}")
    return paths


def read_cifar_batches(folder: Path) -> tuple[list[str], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Class names and, per split, uint8 (N, 3, 32, 32) images with int64 (N,) labels; all seven files are
    checked, whichever split is wanted (a folder is read whole or not at all)."""
    batch_files(folder)
    class_names = read_label_names(folder)
    splits = {}
    for split, names in zip(SPLITS, (CIFAR_TRAIN, CIFAR_TEST), strict=True):
        batches = [read_batch(folder / name, len(class_names)) for name in names]
        images = np.concatenate([data for data, _ in batches]).reshape(-1, 3, 32, 32)
        splits[split] = images, np.concatenate([labels for _, labels in batches])
    return class_names, splits


def _text(value):
    return value.decode("latin1") if isinstance(value, bytes) else value


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _format_error(path: Path, problem: str) -> DataError:
    return DataError(f"{path} is not a CIFAR-10 python batch: {problem}")
