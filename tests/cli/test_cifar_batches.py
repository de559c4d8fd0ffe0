"""torchvision's CIFAR-10 python batches are pickles: reading a data folder must never run code from it, and a
damaged folder must end train.py and eval.py with one line and exit code 2. The folders here are written the
way CIFAR's own files are (dicts with bytes keys, pickled with protocol 2 from numpy arrays); a payload is an
object whose ``__reduce__`` calls ``os.system`` to create a marker file, and the same payload read by plain
``pickle.load`` is shown to create it, so a reader that ran code would fail these tests."""

from __future__ import annotations

import importlib.util
import os
import pickle
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torchvision

from zoo.data import DataError
from zoo.data.cifar import read_cifar_batches, read_label_names

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import train  # noqa: E402

_spec = importlib.util.spec_from_file_location("eval_cli", REPO / "eval.py")
eval_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_cli)

CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
FILES = [*BATCHES, "batches.meta"]


class Payload:
    """Unpickled by a plain ``pickle.load``, it runs ``touch MARKER``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


Edit = Callable[[str, dict], object]  # (file name, its dict) -> what is pickled into the file


def write_batches(root: Path, edit: Edit | None = None, per_batch: int = 6, seed: int = 0) -> Path:
    """root/cifar-10-batches-py as CIFAR-10's files are: dicts with bytes keys and values, ``data`` a uint8
    (N, 3072) array, ``labels`` a list of ints, pickled with protocol 2; ``edit`` may change a file's dict (or
    return something else to pickle). Returns the folder."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in FILES:
        if name == "batches.meta":
            content = {b"num_cases_per_batch": per_batch, b"label_names": [n.encode() for n in CIFAR_NAMES],
                       b"num_vis": 3072}
        else:
            content = {b"batch_label": f"{name} of 6".encode(), b"labels": rng.integers(0, 10, per_batch).tolist(),
                       b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                       b"filenames": [f"{name}_{i}.png".encode() for i in range(per_batch)]}
        content = edit(name, content) if edit else content
        if content is not None:
            with open(folder / name, "wb") as f:
                pickle.dump(content, f, protocol=2)
    return folder


def plain_load(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


# ------------------------------------------------------------------------------------------- the reader itself

def test_batches_written_like_cifar_read_as_plain_pickle_reads_them(tmp_path):
    folder = write_batches(tmp_path)
    class_names, splits = read_cifar_batches(folder)
    assert class_names == [n.decode() for n in plain_load(folder / "batches.meta")[b"label_names"]] == CIFAR_NAMES
    for split, names in (("train", BATCHES[:5]), ("test", BATCHES[5:])):
        images, labels = splits[split]
        reference = [plain_load(folder / name) for name in names]
        assert images.dtype == np.uint8 and images.shape == (6 * len(names), 3, 32, 32)
        assert np.array_equal(images.reshape(len(images), -1), np.concatenate([r[b"data"] for r in reference]))
        assert labels.tolist() == sum((r[b"labels"] for r in reference), [])


def test_python3_batches_with_str_keys_read_too(tmp_path):
    """The same files pickled with Python 3's own protocol and str keys (how other tools rewrite them)."""
    def rewrite(name, content):
        content = {k.decode(): v for k, v in content.items()}
        return content | {"label_names": CIFAR_NAMES} if name == "batches.meta" else content
    folder = write_batches(tmp_path, rewrite)
    for name in FILES:  # re-pickled with Python 3's default protocol
        (folder / name).write_bytes(pickle.dumps(plain_load(folder / name)))
    class_names, splits = read_cifar_batches(folder)
    assert class_names == CIFAR_NAMES
    assert np.array_equal(splits["test"][0].reshape(6, -1), plain_load(folder / "test_batch")["data"])


def test_the_real_download_reads_as_torchvision_reads_it(cifar_dir):
    folder = cifar_dir / "cifar-10-batches-py"
    if not folder.is_dir():
        pytest.skip(f"no cifar-10-batches-py in {cifar_dir} (the test data is an ImageFolder tree)")
    class_names, splits = read_cifar_batches(folder)
    for split, train_split in (("train", True), ("test", False)):
        reference = torchvision.datasets.CIFAR10(str(cifar_dir), train=train_split, download=False)
        images, labels = splits[split]
        assert class_names == reference.classes and labels.tolist() == reference.targets
        assert np.array_equal(images.transpose(0, 2, 3, 1), reference.data)


@pytest.mark.parametrize("name", FILES)
def test_a_payload_is_refused_naming_the_file_and_runs_nothing(name, tmp_path):
    marker = tmp_path / "marker"
    folder = write_batches(tmp_path / "data", lambda n, c: {**c, b"extra": Payload(marker)} if n == name else c)
    plain_load(folder / name)  # the payload is live: plain pickle runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(DataError, match=rf"refused to read .*{name}: .*it names (posix|os)\.system") as info:
        read_cifar_batches(folder)
    assert "\n" not in str(info.value) and not marker.exists()
    if name == "batches.meta":
        with pytest.raises(DataError, match="system"):
            read_label_names(folder)
        assert not marker.exists()


# ------------------------------------------------------------------------------------------------- through CLIs

def on_command_line(program: str, data: Path, tmp_path: Path, run: Path) -> list[str]:
    if program == "train.py":
        return ["--model", "vit_nano", "--data-dir", str(data), "--out", str(tmp_path / "runs"), "--cache-dir",
                str(tmp_path / "cache"), "--set", "val_size=2"]
    return ["--checkpoint", str(run), "--data-dir", str(data), "--out", str(tmp_path / "eval"), "--cache-dir",
            str(tmp_path / "cache"), "--device", "cpu"]


def run_program(program: str, args: list[str], capsys) -> tuple[int, str]:
    code = (train.main if program == "train.py" else eval_cli.main)(args)
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, match: str) -> None:
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert re.search(match, err), (match, err)


@pytest.mark.parametrize("program", ["train.py", "eval.py"])
@pytest.mark.parametrize("name", FILES)
def test_a_payload_in_any_file_runs_nothing_from_the_command_line(name, program, tiny_run, tmp_path, capsys):
    marker = tmp_path / "marker"
    write_batches(tmp_path / "data", lambda n, c: {**c, b"batch_label": Payload(marker)} if n == name else c)
    code, err = run_program(program, on_command_line(program, tmp_path / "data", tmp_path, tiny_run), capsys)
    assert not marker.exists(), "reading the data folder ran code"
    assert_one_line(code, err, rf"{name}: not a CIFAR-10 python batch .*it names (posix|os)\.system")
    assert not any((tmp_path / "runs").glob("*/*")) and not (tmp_path / "eval").exists()


def drop(key: bytes, file: str) -> Edit:
    return lambda name, content: {k: v for k, v in content.items() if k != key} if name == file else content


def change(file: str, **values) -> Edit:
    return lambda name, content: {**content, **{k.encode(): v(content) for k, v in values.items()}} \
        if name == file else content


DAMAGE = [
    ("missing test_batch", lambda name, content: None if name == "test_batch" else content,
     r"cifar-10-batches-py lacks test_batch: CIFAR-10 python batches are data_batch_1..5, test_batch"),
    ("meta without label_names", drop(b"label_names", "batches.meta"),
     r"batches.meta is not a CIFAR-10 python batch: label_names must be a list of class names, got None"),
    ("label 10", change("data_batch_2", labels=lambda c: [10] + c[b"labels"][1:]),
     r"data_batch_2 is not a CIFAR-10 python batch: labels must lie in 0..9 .*got 10"),
    ("label -1", change("test_batch", labels=lambda c: c[b"labels"][:-1] + [-1]), r"test_batch .*got -1"),
    ("label 2**70", change("data_batch_3", labels=lambda c: [2**70] + c[b"labels"][1:]),
     r"data_batch_3 is not a CIFAR-10 python batch: labels must lie in 0..9 .*got 1180591620717411303424"),
    ("rows of 1024", change("data_batch_3", data=lambda c: c[b"data"][:, :1024].copy()),
     r"data_batch_3 .*data must be uint8 of shape \(N, 3072\), got uint8 \(6, 1024\)"),
    ("float data", change("data_batch_1", data=lambda c: c[b"data"].astype(np.float32)),
     r"data_batch_1 .*got float32 \(6, 3072\)"),
    ("one label short", change("data_batch_5", labels=lambda c: c[b"labels"][:-1]), r"5 labels for 6 images"),
    ("no data key", drop(b"data", "test_batch"), r"test_batch .*lacks the key\(s\) data"),
    ("a list, not a dict", lambda name, content: [1, 2] if name == "data_batch_4" else content,
     r"data_batch_4 .*holds a list, not a dict"),
]


@pytest.mark.parametrize("program", ["train.py", "eval.py"])
@pytest.mark.parametrize("what, edit, match", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damage_is_one_line_from_the_command_line(what, edit, match, program, tiny_run, tmp_path, capsys):
    write_batches(tmp_path / "data", edit)
    code, err = run_program(program, on_command_line(program, tmp_path / "data", tmp_path, tiny_run), capsys)
    assert_one_line(code, err, match)
    assert not any((tmp_path / "runs").glob("*/*")) and not (tmp_path / "eval").exists()


def test_a_truncated_batch_is_one_line(tiny_run, tmp_path, capsys):
    folder = write_batches(tmp_path / "data")
    (folder / "data_batch_2").write_bytes((folder / "data_batch_2").read_bytes()[:500])
    code, err = run_program("train.py", on_command_line("train.py", tmp_path / "data", tmp_path, tiny_run), capsys)
    assert_one_line(code, err, r"refused to read .*data_batch_2: not a CIFAR-10 python batch")
    assert not any((tmp_path / "runs").glob("*/*"))
