"""The prepared GPU check in its dry form, on whatever device there is: every step runs (the CUDA tests are
collected and run, skipping without a GPU; the vit_tiny runs, the one with ``--compile step`` only on a GPU; the
speedrun recipe's run) but the benchmark suite, whose quick form tests/bench/test_bench_suite.py runs already; the
report is written in both forms, and the time-to-accuracy reading agrees with a metrics.csv written by hand. The
default suite tests the check's parts (time to accuracy, a step past its time, the refusal without a GPU); its dry
runs, of the vit_tiny step, of the training steps and of every step, run under ``-m slow``: run them before a GPU
session."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.anchor import side_by_side
from benchmarks.gpu_check import ANCHOR_DIR, CUDA_TEST_FILES, epoch_times, time_to
from benchmarks.gpu_check import main as gpu_check_main

REPO = Path(__file__).resolve().parents[2]


def test_time_to_accuracy_reads_the_first_validation_past_each_target(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("epoch,step,train/loss,val/top1,time/elapsed_s\n"
                       "0,10,2.0,,\n0,49,,0.71,5.5\n1,98,,0.8999999761581421,11.0\n2,147,,0.89,16.5\n"
                       "3,196,,0.941,22.0\n")  # 0.8999999761581421: 0.9 logged in float32
    assert time_to(metrics) == {"seconds_to_90": 11.0, "seconds_to_94": 22.0}
    assert time_to(metrics, (0.95,)) == {"seconds_to_95": None}
    assert epoch_times(metrics) == {"first_epoch_s": 5.5, "later_epoch_s": 5.5}


@pytest.mark.parametrize("left_out", [
    pytest.param(("suite", "cuda_tests", "speedrun", "anchor", "muon"), id="vit-tiny", marks=pytest.mark.slow),
    pytest.param(("suite", "cuda_tests", "anchor", "muon"), id="training-steps", marks=pytest.mark.slow),
    pytest.param(("suite",), id="every-step", marks=pytest.mark.slow),
])
def test_dry_run_runs_every_step_and_writes_the_report(cifar_dir, tmp_path, left_out, monkeypatch, capsys):
    out = tmp_path / "check"
    skip = [*left_out] + ([] if "anchor" in left_out or (ANCHOR_DIR / "airbench94_cpu.py").is_file() else ["anchor"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # the check in this process; its steps are subprocesses, as on the GPU machine
    code = gpu_check_main(["--dry-run", "--data-dir", str(cifar_dir), "--out", str(out), "--skip", *skip])
    done = capsys.readouterr()
    report = json.loads((out / "gpu_check.json").read_text())
    failed = {k: v.get("error") for k, v in report.items() if isinstance(v, dict) and not v["ok"]}
    assert code == 0 and not failed, (failed, done.err[-2000:])
    assert report["dry_run"] is True and report["skipped"] == skip and "suite" not in report
    if "muon" not in skip:
        assert report["muon"]["vit_nano_torch_loop_bf16_ms"] > 0 and report["muon"]["vit_nano_matrices"] > 0
    if "anchor" not in skip:  # the real anchor script, a fifth of an epoch on 100 images, beside the speedrun
        assert 0 <= report["anchor"]["anchor_test_top1_tta"] <= 1 and report["anchor"]["anchor_epochs"] == 0.2
        assert report["anchor"]["zoo_test_top1_tta"] == report["speedrun"]["test_top1"]
        assert "| test top-1, TTA |" in (out / "gpu_check.md").read_text()
    if "cuda_tests" not in skip:
        assert report["cuda_tests"]["skipped" if not torch.cuda.is_available() else "passed"] >= 20
    steps = [s for s in ("vit_tiny", "vit_tiny_step", "speedrun") if s not in skip
             and (s != "vit_tiny_step" or torch.cuda.is_available())]
    assert torch.cuda.is_available() or "not_run" in report["vit_tiny_step"]  # its compile takes a minute on a CPU
    for step in steps:
        summary = json.loads((Path(report[step]["run"]) / "summary.json").read_text())
        assert summary["test_top1"] == report[step]["test_top1"]
    if "speedrun" not in skip:
        assert report["speedrun"]["data"] == "JPEG image folder" or (cifar_dir / "cifar-10-batches-py").is_dir()
        assert set(report["speedrun"]) >= {"seconds_to_90", "seconds_to_94", "first_epoch_s", "later_epoch_s"}
    profile = report["vit_tiny"]
    assert profile["step_ms"] > 0 and profile["device_kernels_per_step"] >= 0 and 0 <= profile["device_busy_share"]
    text = (out / "gpu_check.md").read_text()
    for step in ("speedrun", "cuda_tests"):
        assert (f"## {step}" in text) == (step not in skip)
    assert done.out.strip().splitlines()[-1] == str(out / "gpu_check.md")


def test_the_check_runs_every_cuda_marked_test():
    """The check collects only ``CUDA_TEST_FILES``: a CUDA test marked in any other file would never run there."""
    marked = {str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("*.py")
              if re.search(r"pytest\.mark\.cuda\b", path.read_text())}
    assert "tests/gpu/test_cuda.py" in marked and marked <= set(CUDA_TEST_FILES), marked - set(CUDA_TEST_FILES)


def test_without_a_gpu_the_real_check_refuses_in_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a CUDA GPU")
    code = gpu_check_main(["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0 and "--dry-run" in err and not any(tmp_path.iterdir())


def test_steps_not_begun_within_the_time_limit_are_reported_and_the_report_is_written_after_each(tmp_path,
                                                                                                  monkeypatch):
    from benchmarks import gpu_check

    seen = []

    def slow_environment():  # spends the whole limit; the report on disk must not have the next step yet
        import time
        time.sleep(0.3)
        return {"torch": "x"}

    def record(*args):
        seen.append(json.loads((tmp_path / "gpu_check.json").read_text()))
        return {}

    monkeypatch.setattr(gpu_check, "environment", slow_environment)
    monkeypatch.setattr(gpu_check, "cuda_tests", record)
    report = gpu_check.run_check(tmp_path, skip=("suite",), time_limit=0.2)
    assert report["environment"] == {"ok": True, "torch": "x", "seconds": report["environment"]["seconds"]}
    assert not seen  # cuda_tests never ran
    for step in ("cuda_tests", "vit_tiny", "vit_tiny_step", "speedrun"):
        assert not report[step]["ok"] and "time limit" in report[step]["error"]
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report
    assert "## speedrun" in (tmp_path / "gpu_check.md").read_text()


def test_a_step_subprocess_past_its_time_is_stopped_and_its_output_kept(tmp_path):
    from benchmarks.gpu_check import _run

    log = tmp_path / "step.log"
    with pytest.raises(RuntimeError, match="time limit"):
        _run([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], log, timeout=3)
    assert log.read_text() == "started\n"


def test_device_time_counts_kernels_not_the_annotations_that_span_them():
    from types import SimpleNamespace

    from benchmarks.gpu_check import device_kernels

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(key="gemm", device_type=cuda, is_user_annotation=False),
              SimpleNamespace(key="Optimizer.step#AdamW.step", device_type=cuda, is_user_annotation=True),
              SimpleNamespace(key="aten::mm", device_type=cpu, is_user_annotation=False)]
    assert [e.key for e in device_kernels(events)] == ["gemm"]


def test_host_launches_count_a_graph_replay_once_not_its_kernels():
    from types import SimpleNamespace

    from benchmarks.gpu_check import device_kernels, host_launches

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(key="gemm", device_type=cuda, is_user_annotation=False, count=40),
              SimpleNamespace(key="cudaGraphLaunch", device_type=cpu, is_user_annotation=False, count=1),
              SimpleNamespace(key="cudaLaunchKernel", device_type=cpu, is_user_annotation=False, count=3),
              SimpleNamespace(key="aten::mm", device_type=cpu, is_user_annotation=False, count=40)]
    assert sum(e.count for e in host_launches(events)) == 4
    assert sum(e.count for e in device_kernels(events)) == 40


def test_side_by_side_puts_the_anchor_beside_the_speedrun():
    result = {"anchor_wall_s": 5.1, "anchor_epochs": 9.9, "anchor_train_img_s": 150000.0,
              "anchor_test_top1_tta": 0.9123, "anchor_timed_s": 3.9, "zoo_wall_s": 40.0, "zoo_epochs": 12,
              "zoo_train_img_s": 90000.0, "zoo_test_top1_tta": 0.905, "zoo_seconds_to_anchor_top1": None}
    lines = side_by_side(result)
    assert lines[2] == "| wall seconds (with compilation / cuDNN tuning) | 5.1 | 40 |"
    assert "| test top-1, TTA | 0.9123 | 0.905 |" in lines
    assert lines[-2] == ("\nThe zoo's validation top-1 never reached airbench94's test top-1 (0.9123); airbench94 "
                         "timed 3.9 s (training and its TTA evaluation).")
    reached = side_by_side({**result, "zoo_seconds_to_anchor_top1": 31.25})[-2]
    assert "first reached airbench94's test top-1 (0.9123) after 31.2 s of its fit" in reached
    assert side_by_side({k: v for k, v in result.items() if not k.startswith("zoo_")}) == []
