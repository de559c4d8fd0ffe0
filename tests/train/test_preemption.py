"""Preemption and exact resume: a signal at step k saves last.ckpt at step k (no summary.json, exit 128 + signal),
and ``--resume auto`` then ends with the same weights and the same metrics.csv, row for row, as the same run
uninterrupted (fp32, same seed: the data order, augmentation, stochastic depth and mixup all draw from the states
the checkpoint carries, and the epoch's metrics so far are in it). The reference is the uninterrupted run; a resume
that drew one batch or one random number differently, or counted an epoch's batches differently, would differ."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zoo.models.run_files import read_metrics
from zoo.train import cli, loop

REPO = Path(__file__).resolve().parents[2]
STEPS_PER_EPOCH = 4  # 96 images - 32 held out = 64, in batches of 16
EPOCHS = 2


@pytest.fixture(scope="module")
def base_argv(cifar_dir, tmp_path_factory):
    return ["--model", "vit_nano", "--data-dir", str(cifar_dir), "--cache-dir", str(tmp_path_factory.mktemp("cache")),
            "--max-train-images", "96", "--max-test-images", "16", "--set", "val_size=32", "--batch-size", "16",
            "--epochs", str(EPOCHS), "--precision", "32", "--accelerator", "cpu", "--limit-val-batches", "1",
            "--limit-test-batches", "1", "--set", "ema_decay=0.9", "--set", "model_args.embed_dim=32",
            "--set", "model_args.depth=1", "--ckpt-every-n-steps", "2"]  # metrics.csv: a step's row every 2 steps


@pytest.fixture
def argv(base_argv, tmp_path):
    return [*base_argv, "--out", str(tmp_path / "runs")]


class _OnHook:
    """Runs ``action(run)`` once, at the first call of the loop's hook ``hook`` (e.g. on_test_batch_start)."""

    def __init__(self, hook: str, action):
        self.action, self.done = action, False
        setattr(self, hook, self._fire)

    def _fire(self, run):
        if not self.done:
            self.done = True
            self.action(run)


def _kill(*signums):
    return lambda run: [os.kill(os.getpid(), signum) for signum in signums]


class _AtStep:
    """Runs ``action(run)`` once, at the end of optimizer step ``step`` (of the first run it sees)."""

    def __init__(self, step: int, action):
        self.step, self.action, self.done = step, action, False

    def on_train_batch_end(self, run):
        if run.position.step == self.step and not self.done:
            self.done = True
            self.action(run)


def _run(argv, monkeypatch=None, extra=None) -> int:
    """cli.main(argv) in this process, with ``extra`` (an object with hooks of the loop) among the run's
    callbacks."""
    with pytest.MonkeyPatch.context() as mp:
        if extra is not None:
            mp.setattr(loop, "fit", functools.partial(loop.fit, callbacks=[extra]))
        return cli.main(argv)


def _only_run(tmp_path) -> Path:
    (run,) = (tmp_path / "runs" / "vit_nano").iterdir()
    return run


def _weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == STEPS_PER_EPOCH * EPOCHS
    return ckpt["state_dict"]


@pytest.fixture(scope="module")
def reference_run(base_argv, tmp_path_factory) -> Path:
    """The reference: the same run, not interrupted (its run directory)."""
    out = tmp_path_factory.mktemp("reference")
    assert _run([*base_argv, "--out", str(out)]) == 0
    (run,) = (out / "vit_nano").iterdir()
    return run


@pytest.fixture(scope="module")
def uninterrupted(reference_run):
    """The reference's last.ckpt weights."""
    return _weights(reference_run)


def _rows(run: Path, through_step: int | None = None) -> tuple[list[str], list[dict]]:
    """metrics.csv's header and rows (those of the training through optimizer step ``through_step``: its step and
    epoch rows, not the test's), clock columns out."""
    keys, rows = read_metrics(run / "metrics.csv")
    rows = [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows
            if through_step is None or int(row["step"]) <= through_step and not row["test/top1"]]
    return [k for k in keys if not k.startswith("time/")], rows


def _same_rows(run: Path, reference: Path, through_step: int | None = None) -> None:
    keys, rows = _rows(run, through_step)
    want_keys, want = _rows(reference, through_step)
    assert len(rows) == len(want) and rows, (rows, want)
    for row, expected in zip(rows, want, strict=True):  # the keys of the rows logged so far
        assert {k: v for k, v in row.items() if v} == {k: v for k, v in expected.items() if v}, (row, expected)


def _assert_same(resumed: dict, reference: dict) -> None:
    assert resumed.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(resumed[key], reference[key], rtol=0, atol=0, msg=key)


# the default suite: one case of each kind of stop; the other signals and places under -m slow
@pytest.mark.parametrize(("signum", "step", "hook"), [
    pytest.param(signal.SIGTERM, 2, None, id="sigterm-mid-epoch0"),
    pytest.param(signal.SIGINT, 5, None, id="sigint-mid-epoch1"),
    pytest.param(signal.SIGTERM, 4, None, id="sigterm-last-step-of-epoch0", marks=pytest.mark.slow),
    pytest.param(signal.SIGTERM, 4, "on_validation_batch_start", id="sigterm-in-validation-of-epoch0",
                 marks=pytest.mark.slow)])
def test_signal_saves_at_the_step_and_resume_equals_the_uninterrupted_run(
        argv, tmp_path, monkeypatch, capsys, uninterrupted, reference_run, signum, step, hook):
    """Stopped and resumed, the run ends with the reference's weights and metrics.csv; right after the stop
    metrics.csv holds every row the reference logged before that step (the stopped step's and epoch's own rows
    included, and epoch 0's training top-5 / mean loss over all its batches after the resume)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    trigger = _OnHook(hook, _kill(signum)) if hook else _AtStep(step, _kill(signum))
    code = _run(argv, monkeypatch, trigger)
    assert code == 128 + signum
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.py:")]
    assert len(err) == 1 and "--resume auto" in err[0] and signal.Signals(signum).name in err[0], err
    run = _only_run(tmp_path)
    assert not (run / "summary.json").exists()
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == step
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are given back
    _same_rows(run, reference_run, through_step=step)

    assert _run([*argv, "--resume", "auto"], monkeypatch) == 0
    assert _only_run(tmp_path) == run and (run / "summary.json").is_file()
    _assert_same(_weights(run), uninterrupted)
    _same_rows(run, reference_run)


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGTERM, id="sigterm"),
                                    pytest.param(signal.SIGUSR1, id="sigusr1", marks=pytest.mark.slow)])
def test_the_same_signal_twice_in_training_stops_once_at_the_step(argv, tmp_path, monkeypatch, capsys, uninterrupted,
                                                                  signum):
    """A scheduler that repeats its SIGTERM (or SIGUSR1) before the step ends: the second is ignored; one
    checkpoint at the step, exit 128 + the signal, and the resume ends with the uninterrupted run's weights."""
    assert _run(argv, monkeypatch, _AtStep(3, _kill(signum, signum))) == 128 + signum
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.py:")]
    assert len(err) == 1 and "--resume auto" in err[0], err
    run = _only_run(tmp_path)
    assert torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 3
    assert _run([*argv, "--resume", "auto"], monkeypatch) == 0
    _assert_same(_weights(run), uninterrupted)


@pytest.mark.parametrize(("signums", "write", "code"), [
    pytest.param([signal.SIGTERM], 1, 143, id="sigterm", marks=pytest.mark.slow),
    pytest.param([signal.SIGUSR1], 1, 138, id="sigusr1", marks=pytest.mark.slow),
    pytest.param([signal.SIGINT, signal.SIGINT], 2, 130, id="ctrl-c-twice")])
def test_a_signal_while_a_checkpoint_is_written_keeps_a_whole_one_and_resumes_exactly(
        argv, tmp_path, monkeypatch, capsys, uninterrupted, reference_run, signums, write, code):
    """The signals arrive inside the ``write``-th write of last.ckpt (every 2 steps here), its bytes in the temp
    file and not yet moved onto last.ckpt. One signal: that write completes and the run stops at the step with
    its checkpoint. Ctrl-C twice: the run stops inside the write, which is abandoned; the previous last.ckpt
    stays whole, no temp file is left, and --resume auto still ends with the uninterrupted run's weights."""
    from zoo.train import runs

    real, writes = runs.atomic_write, []

    def write_then_signal(path, write_file):
        def inner(f):
            write_file(f)
            if Path(path).name == "last.ckpt":
                writes.append(path)
                if len(writes) == write:
                    for signum in signums:
                        os.kill(os.getpid(), signum)
        return real(path, inner)

    monkeypatch.setattr(runs, "atomic_write", write_then_signal)
    assert _run(argv, monkeypatch) == code
    monkeypatch.setattr(runs, "atomic_write", real)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.py:")]
    assert len(err) == 1 and "--resume auto" in err[0], err
    run = _only_run(tmp_path)
    checkpoints = run / "checkpoints"
    assert not [p.name for p in checkpoints.iterdir() if p.name.endswith(".tmp")]
    saved = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 2  # the first write (steps 2): completed, or the one before the abandoned one
    assert _run([*argv, "--resume", "auto"], monkeypatch) == 0
    _assert_same(_weights(run), uninterrupted)
    _same_rows(run, reference_run)


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGTERM, id="sigterm", marks=pytest.mark.slow),
                                    pytest.param(signal.SIGINT, id="ctrl-c")])
def test_a_signal_during_the_final_test_exits_128_plus_it_and_resume_tests(
        argv, tmp_path, monkeypatch, capsys, reference_run, signum):
    """Lightning exited 0 on SIGTERM during the test (no line, no summary.json) and 1 on Ctrl-C: 143 / 130 with one
    line naming --resume auto, which then runs the test; metrics.csv ends as the reference's, and a further resume
    of the finished run leaves it byte for byte (its test row too)."""
    assert _run(argv, monkeypatch, _OnHook("on_test_batch_start", _kill(signum))) == 128 + signum
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "during the final test" in err[0] and "--resume auto" in err[0], err
    run = _only_run(tmp_path)
    assert not (run / "summary.json").exists()
    _same_rows(run, reference_run, through_step=STEPS_PER_EPOCH * EPOCHS)
    assert _run([*argv, "--resume", "auto"], monkeypatch) == 0
    assert (run / "summary.json").is_file()
    _same_rows(run, reference_run)
    metrics = (run / "metrics.csv").read_bytes()
    assert _run([*argv, "--resume", "auto"], monkeypatch) == 0  # finished: nothing to train
    assert (run / "metrics.csv").read_bytes() == metrics


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=["sigterm", "sigusr1",
                                                                                        "ctrl-c"])
def test_a_signal_while_the_data_are_decoded_or_probed_exits_128_plus_it_in_one_line(argv, tmp_path, monkeypatch,
                                                                                      capsys, signum):
    """Before training (decoding, the precision and optimizer probes) SIGTERM and SIGUSR1 ended the process by
    their default action, without a line: 128 + the signal and one line saying nothing was written, no run folder."""
    def signalled_plan(recipe):
        os.kill(os.getpid(), signum)
        time.sleep(30)  # the handler raises before this returns
        raise AssertionError("the signal was not handled")

    monkeypatch.setattr(loop, "plan_run", signalled_plan)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    assert cli.main(argv) == 128 + signum
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "before training" in err[0] and "nothing to resume" in err[0], err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.ckpt"))
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers were put back


def test_ctrl_c_twice_before_the_first_checkpoint_exits_130_without_naming_resume(argv, tmp_path, monkeypatch,
                                                                                 capsys):
    """A second Ctrl-C stops at once: exit 130 (Lightning's KeyboardInterrupt handling made it 1), one line that
    does not offer --resume auto when no checkpoint was written; the new run's folder is removed."""
    assert _run(argv, monkeypatch, _AtStep(1, _kill(signal.SIGINT, signal.SIGINT))) == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "nothing to resume" in err[0] and "--resume" not in err[0], err
    assert not list((tmp_path / "runs" / "vit_nano").glob("*/checkpoints/last.ckpt"))


def test_a_resume_whose_weights_do_not_fit_is_one_line_and_keeps_metrics(argv, tmp_path, monkeypatch, capsys,
                                                                         reference_run):
    """A checkpoint whose head has another shape: one line (exit 2), not Lightning's size-mismatch traceback after
    metrics.csv was rewritten without its test row."""
    run = tmp_path / "runs" / "vit_nano" / reference_run.name
    shutil.copytree(reference_run, run)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    ckpt["state_dict"]["model.head.weight"] = torch.zeros(10, 7)
    torch.save(ckpt, run / "checkpoints" / "last.ckpt")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert _run([*argv, "--resume", "auto", "--epochs", "3"], monkeypatch) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "head.weight [10, 7] in the checkpoint, [10, 32] in the model" in err[0], err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"} == before


def test_resume_from_the_interval_checkpoint_after_a_hard_kill_equals_the_uninterrupted_run(
        argv, tmp_path, monkeypatch, uninterrupted):
    """kill -9 at step 7 (a crash: no handler runs, nothing is saved then) leaves the step-3 checkpoint of
    --ckpt-every-n-steps 3... then step 6's; resuming from step 6 ends as the uninterrupted run."""

    def crash(run):
        raise MemoryError("simulated hard kill")

    with pytest.raises(MemoryError):
        _run([*argv, "--ckpt-every-n-steps", "3"], monkeypatch, _AtStep(7, crash))
    run = _only_run(tmp_path)
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 6
    assert _run([*argv, "--ckpt-every-n-steps", "3", "--resume", "auto"], monkeypatch) == 0
    _assert_same(_weights(run), uninterrupted)


def test_interval_checkpoint_exists_three_minutes_into_a_run(argv, tmp_path, monkeypatch):
    """On a scripted clock (each optimizer step takes 40 s), a run killed 3 minutes in has a last.ckpt from its
    2-minute checkpoint (--ckpt-every-minutes 2, the default), though no step or epoch checkpoint was due."""
    from zoo.train import clock

    time = {"now": 1000.0}
    monkeypatch.setattr(clock, "now", lambda: time["now"])
    seen = {}

    def look(run):  # at 3 minutes 20 s: what a kill -9 now would leave
        found = list((tmp_path / "runs" / "vit_nano").glob("*/checkpoints/last.ckpt"))
        seen["step"] = torch.load(found[0], weights_only=True)["global_step"] if found else None
        raise MemoryError("simulated hard kill")

    class Both:
        def __init__(self):
            self.look = _AtStep(5, look)

        def on_train_batch_start(self, run):
            time["now"] += 40.0

        def on_train_batch_end(self, run):
            self.look.on_train_batch_end(run)

    with pytest.raises(MemoryError):
        _run([*argv, "--ckpt-every-n-steps", "1000"], monkeypatch, Both())
    assert seen["step"] == 3  # the first step to end at or after 2 minutes (3 x 40 s)


def test_resume_auto_with_nothing_to_resume_says_so(argv, tmp_path, monkeypatch, capsys):
    """--resume auto with no run to resume: one line, then a new run (stopped here at its first step)."""
    code = _run([*argv, "--resume", "auto"], monkeypatch,
                _AtStep(1, lambda trainer: os.kill(os.getpid(), signal.SIGUSR1)))
    assert code == 128 + signal.SIGUSR1
    out = capsys.readouterr().out
    assert sum("--resume auto: no run of vit_nano" in line for line in out.splitlines()) == 1
    # stopped before any training row was logged: metrics.csv is there all the same, as every run's is
    assert "step" in _rows(_only_run(tmp_path))[0]


@pytest.mark.slow
def test_sigterm_from_outside_exits_143_with_last_ckpt_at_that_step(argv, tmp_path):
    """A real train.py process, SIGTERM from outside once its first checkpoint exists: exit 143, one line,
    last.ckpt at or after that checkpoint's step, no summary.json."""
    cmd = [sys.executable, str(REPO / "train.py"), *argv, "--epochs", "50", "--ckpt-every-n-steps", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline, found = time.time() + 240, []
    while time.time() < deadline and proc.poll() is None and not found:
        found = list((tmp_path / "runs").glob("vit_nano/*/checkpoints/last.ckpt"))
        time.sleep(0.05)
    assert found, "no checkpoint appeared"
    first = torch.load(found[0], weights_only=True)["global_step"]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("train.py:")]
    assert len(lines) == 1 and "SIGTERM" in lines[0] and "--resume auto" in lines[0]
    run = found[0].parent.parent
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert first <= saved["global_step"] < 50 * STEPS_PER_EPOCH
    assert not (run / "summary.json").exists()
