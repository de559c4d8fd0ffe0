"""State files a run can trust: the run-directory lock (a second process is refused in one line, a dead holder's
lock is taken over), precision-choices.json (concurrent writers keep both entries; an invalid or foreign stored
value is measured again with a warning), and the validating reader of summary.json / metrics.csv (one line naming
the file, from --resume and from load_run)."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zoo.models.run_files import read_metrics, read_summary
from zoo.train import cli
from zoo.train.probes import remembered_choice
from zoo.train.runs import LOCK_FILE, RunLock

HOLD = ("import sys, time; from pathlib import Path; from zoo.train.runs import RunLock; "
        "RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(60)")


def hold_in_another_process(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_run_directory_held_by_a_live_process_is_refused(tmp_path):
    proc = hold_in_another_process(tmp_path)
    try:
        with pytest.raises(ValueError, match=rf"in use by another train.py \(process {proc.pid}\)"):
            RunLock(tmp_path).acquire()
    finally:
        proc.kill()
        proc.wait()
    lock = RunLock(tmp_path).acquire()  # its holder died: the kernel dropped the lock
    lock.release()


def test_a_dead_holders_lock_is_taken_over_with_one_line(tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(dead.stdout)  # what a kill -9 leaves
    lock = RunLock(tmp_path).acquire()
    assert f"taking over the lock of process {dead.stdout.strip()}" in capsys.readouterr().out
    lock.release()
    RunLock(tmp_path).acquire().release()  # released cleanly: no takeover line
    assert "taking over" not in capsys.readouterr().out


@pytest.mark.slow  # a resume beside a holding process; the default suite keeps the lock's refusal above
def test_resume_of_a_run_another_process_holds_exits_2_in_one_line(tiny_run, cifar_dir, tmp_path, capsys):
    run = tmp_path / "runs" / "vit_nano" / tiny_run.name
    shutil.copytree(tiny_run, run)
    proc = hold_in_another_process(run)
    try:
        code = cli.main(["--model", "vit_nano", "--resume", "auto", "--out", str(tmp_path / "runs"),
                         "--data-dir", str(cifar_dir), "--cache-dir", str(tmp_path / "cache"), "--epochs", "2",
                         "--max-train-images", "128", "--max-test-images", "32", "--set", "val_size=32",
                         "--batch-size", "32", "--limit-train-batches", "2", "--limit-val-batches", "1"])
    finally:
        proc.kill()
        proc.wait()
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.py:")]
    assert len(err) == 1 and "in use by another train.py" in err[0]


def _write_choice(path: str, key: str, value: str) -> None:
    def slow_measure():
        time.sleep(1.0)  # both processes read the file before either writes
        return value
    remembered_choice(Path(path), key, slow_measure)


def test_two_processes_writing_precision_choices_keep_both_entries(tmp_path):
    path = tmp_path / "precision-choices.json"
    path.write_text(json.dumps({"old": "32"}))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_choice, args=(str(path), key, value))
             for key, value in (("a", "bf16-mixed"), ("b", "32"))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert json.loads(path.read_text()) == {"old": "32", "a": "bf16-mixed", "b": "32"}


@pytest.mark.parametrize("stored", ["garbage", "64", "16-mixed", 5, None])
def test_an_invalid_or_foreign_stored_choice_is_measured_again_with_a_warning(tmp_path, stored):
    path, calls = tmp_path / "precision-choices.json", []
    path.write_text(json.dumps({"k": stored, "other": "32"}))

    def measure():
        calls.append(1)
        return "bf16-mixed"

    if stored is None:  # null is a missing value: measured without a warning
        assert remembered_choice(path, "k", measure, ("32", "bf16-mixed")) == ("bf16-mixed", True)
    else:
        with pytest.warns(UserWarning, match=rf"{path.name}: the stored choice .* measuring again"):
            assert remembered_choice(path, "k", measure, ("32", "bf16-mixed")) == ("bf16-mixed", True)
    assert calls == [1] and json.loads(path.read_text()) == {"k": "bf16-mixed", "other": "32"}
    assert remembered_choice(path, "k", measure, ("32", "bf16-mixed")) == ("bf16-mixed", False)


SUMMARY = {"model": "vit_nano", "num_classes": 2, "class_names": ["a", "b"], "mean": [0.5, 0.5, 0.5],
           "std": [0.2, 0.2, 0.2], "img_size": 32, "test_top1": 0.5, "best_val_top1": None}


@pytest.mark.parametrize(("text", "problem"), [
    ('{"class_names": 5}', "class_names is 5"),
    ('[1, 2]', "a JSON list, not an object"),
    ('{"model": "vit_na', "not JSON"),
    (json.dumps({**SUMMARY, "class_names": ["a", 3]}), "non-string"),
    (json.dumps({**SUMMARY, "num_classes": 3}), "2 class_names for num_classes 3"),
    (json.dumps({**SUMMARY, "mean": [0.5, 0.5]}), "mean is"),
    (json.dumps({**SUMMARY, "test_top1": "high"}), "test_top1 is 'high'"),
])
def test_a_damaged_summary_is_one_line_naming_the_file(tmp_path, text, problem):
    path = tmp_path / "summary.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem) as err:
        read_summary(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_whole_summary_reads_as_json(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(SUMMARY))
    assert read_summary(path) == SUMMARY


@pytest.mark.parametrize(("text", "problem"), [
    ("epoch,loss\n0,1.0\n", "no step column"),
    ("step,loss\nabc,1.0\n", "step 'abc' is not a whole number"),
    ("step,loss\n1,1.0,7\n2,0.5\n", "line 2 has more fields"),
    ("step,loss\n1\n2,0.5\n", "line 2 has fewer fields"),
])
def test_a_damaged_metrics_csv_is_one_line_naming_the_file(tmp_path, text, problem):
    path = tmp_path / "metrics.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem) as err:
        read_metrics(path)
    assert str(path) in str(err.value)


def test_a_metrics_csv_cut_off_in_its_last_row_keeps_the_whole_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,loss,top1\n1,1.0,0.1\n2,0.5,0.2\n3,0.4")
    assert read_metrics(path) == (["step", "loss", "top1"], [{"step": "1", "loss": "1.0", "top1": "0.1"},
                                                             {"step": "2", "loss": "0.5", "top1": "0.2"}])


def test_load_run_and_resume_name_a_damaged_summary(tiny_run, cifar_dir, tmp_path, capsys):
    from zoo.models.checkpoints import load_run

    run = tmp_path / "runs" / "vit_nano" / tiny_run.name
    shutil.copytree(tiny_run, run)
    (run / "summary.json").write_text('{"class_names": 5}')
    with pytest.raises(ValueError, match="summary.json is damaged"):
        load_run(run)
    code = cli.main(["--model", "vit_nano", "--resume", str(run), "--out", str(tmp_path / "runs"),
                     "--data-dir", str(cifar_dir), "--cache-dir", str(tmp_path / "cache"), "--epochs", "2",
                     "--max-train-images", "128", "--max-test-images", "32", "--set", "val_size=32",
                     "--batch-size", "32", "--limit-train-batches", "2", "--limit-val-batches", "1"])
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.py:")]
    assert len(err) == 1 and "summary.json is damaged (class_names is 5" in err[0]
