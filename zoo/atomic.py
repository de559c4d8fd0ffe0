"""Crash-safe file writes: the new content goes to a temporary file beside the target, is fsynced, and is
renamed over the target (``os.replace`` is atomic on POSIX), so a process killed mid-write leaves the old
file intact. Used for checkpoints, summary and other JSON files, CSV tables, reports, figures and the data cache."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(file)`` on a temp file beside ``path``, fsync it, then ``os.replace`` it onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """``text`` (UTF-8) written whole through ``atomic_write``."""
    atomic_write(path, lambda f: f.write(text.encode()))


def atomic_write_csv(path: str | Path, fieldnames: Sequence[str], rows: Iterable[Mapping], **options) -> None:
    """A CSV file (header, then ``rows``) written whole through ``atomic_write``; ``options``: csv.DictWriter's."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(fieldnames), **options)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, text.getvalue())


def atomic_write_json(path: str | Path, data) -> None:
    """``data`` as indented JSON (and a final newline) written whole through ``atomic_write``."""
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


@contextlib.contextmanager
def locked(path: str | Path):
    """Hold an exclusive advisory lock (``fcntl.flock``) on the file ``path`` (created if absent) for the block, so
    read-modify-write updates of a shared file by several processes do not lose each other's entries. The
    kernel releases it if the process dies. Where ``fcntl`` does not exist (Windows) the block runs unlocked."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield f
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
