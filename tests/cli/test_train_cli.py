"""train.py on a small slice of the real CIFAR-10 JPEGs: a smoke run per registered model, bf16 on CPU,
seeded reproducibility, and user errors (one stderr line, exit code 2). The runs call train.main in-process
(importing Lightning once); tests/cli/test_bad_inputs.py runs the programs from the shell."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import slow_except

import zoo
from zoo.runtime.device import cpu_has_native_bf16

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import train  # noqa: E402

SUMMARY_KEYS = {"model", "params", "flops", "precision", "accelerator", "devices", "epochs", "global_step",
                "wall_time_s", "train_images_per_s", "best_val_top1", "test_top1", "test_top5"}


@pytest.fixture(scope="module")
def slice_args(cifar_dir, tmp_path_factory):
    """Flags for a tiny, fast run on real images; the uint8 cache is decoded once per module."""
    cache = tmp_path_factory.mktemp("cache")
    return ["--data-dir", str(cifar_dir), "--cache-dir", str(cache), "--max-train-images", "400",
            "--max-test-images", "64", "--set", "val_size=64", "--epochs", "1", "--batch-size", "8",
            "--limit-train-batches", "2", "--limit-val-batches", "1", "--limit-test-batches", "1"]


def run_main(args, capsys):
    code = train.main(args)
    out, err = capsys.readouterr()
    return code, out, err


# the default suite: one model of each family (ViT, hybrid, ResNet) and the README's; the rest under -m slow
@pytest.mark.parametrize("name", slow_except(zoo.list_models(), ("vit_nano", "vit_tiny", "hybrid_tiny", "resnet18")))
def test_smoke_run_per_model(name, slice_args, tmp_path, capsys):
    code, out, err = run_main(["--model", name, "--out", str(tmp_path), *slice_args], capsys)
    assert code == 0, err[-2000:]
    run_dir = tmp_path / name / out.strip().splitlines()[-1].split("/")[-1]
    assert out.strip().splitlines()[-1] == str(run_dir)
    files = ("config.yaml", "metrics.csv", "summary.json", "checkpoints/last.ckpt", "checkpoints/best.ckpt")
    for rel in files:
        assert (run_dir / rel).is_file(), rel
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    # auto: 32 without native bf16; with it, whichever the run measured faster (test_optim_tta)
    auto = {"32", "bf16-mixed"} if cpu_has_native_bf16() else {"32"}
    assert summary["model"] == name and summary["global_step"] == 2 and summary["precision"] in auto
    size = summary["img_size"]  # the recipe's (64 for vit_local_tiny)
    assert summary["params"] == sum(p.numel() for p in zoo.create_model(name, img_size=size).parameters())
    assert all(0 <= summary[k] <= 1 for k in ("best_val_top1", "test_top1", "test_top5"))
    model, meta = zoo.load_run(run_dir)
    assert meta["summary"]["model"] == name and meta["config"]["model"] == name
    assert model(torch.zeros(1, 3, size, size)).shape == (1, 10)


def test_bf16_mixed_on_cpu(slice_args, tmp_path, capsys):
    args = ["--config", str(REPO / "configs" / "test_tiny.yaml"), "--precision", "bf16-mixed",
            "--out", str(tmp_path), *slice_args, "--limit-train-batches", "1"]
    code, out, err = run_main(args, capsys)
    assert code == 0, err[-2000:]
    summary = json.loads((REPO / out.strip().splitlines()[-1] / "summary.json").read_text())
    assert summary["precision"] == "bf16-mixed" and summary["global_step"] == 1


def first_epoch_rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if v and not k.startswith("time/")}  # the wall clock differs
                for row in csv.DictReader(f)
                if row["epoch"] == "0"]


def test_same_seed_same_first_epoch_metrics(slice_args, tmp_path, capsys):
    rows = []
    for seed in (0, 0, 1):
        args = ["--config", str(REPO / "configs" / "test_tiny.yaml"), "--seed", str(seed),
                "--out", str(tmp_path / str(len(rows))), *slice_args, "--limit-train-batches", "3",
                "--ckpt-every-n-steps", "1"]  # a step's row every step
        code, out, err = run_main(args, capsys)
        assert code == 0, err[-2000:]
        rows.append(first_epoch_rows(REPO / out.strip().splitlines()[-1]))
    assert rows[0] == rows[1] and len(rows[0]) >= 2
    assert rows[0] != rows[2]


def test_precision_auto_is_measured_once_and_a_resumed_run_keeps_its_own(slice_args, tmp_path, capsys,
                                                                         monkeypatch):
    """On a CPU with native bf16, ``auto`` measures fp32 against bf16 once per machine and model shape (a near tie
    must not make two same-seed runs differ), records the result in config.yaml, and a resumed run keeps it."""
    import zoo.runtime.device as device
    import zoo.train.probes as probes

    measured = []
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(probes, "faster_precision", lambda model, x, options: measured.append(options) or "bf16-mixed")
    cache = tmp_path / "cache"  # this test's own: no other test's measurement remembered there
    args = ["--config", str(REPO / "configs" / "test_tiny.yaml"), *slice_args, "--limit-train-batches", "1",
            "--cache-dir", str(cache)]
    run_dirs = []
    for i in range(2):
        code, out, err = run_main([*args, "--out", str(tmp_path / str(i))], capsys)
        assert code == 0, err[-2000:]
        run_dirs.append(REPO / out.strip().splitlines()[-1])
        assert json.loads((run_dirs[-1] / "summary.json").read_text())["precision"] == "bf16-mixed"
        assert yaml.safe_load((run_dirs[-1] / "config.yaml").read_text())["precision"] == "bf16-mixed"
    assert measured == [("32", "bf16-mixed")]  # the second run reused the first run's measurement

    (cache / probes.PRECISION_FILE).unlink()
    monkeypatch.setattr(probes, "faster_precision", lambda *a: pytest.fail("a resumed run measured again"))
    code, out, err = run_main([*args, "--out", str(tmp_path / "0"), "--resume", str(run_dirs[0]), "--epochs", "2"],
                              capsys)
    assert code == 0, err[-2000:]
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["precision"] == "bf16-mixed" and summary["global_step"] == 2


@pytest.mark.parametrize("extra, message", [
    (["--model", "vit_tiny", "--precision", "fp16"], "precision must be one of"),
    (["--model", "vit_tiny", "--set", "learning_rate=1"], "unknown config key 'learning_rate'"),
    (["--model", "vit_tiny", "--accelerator", "gpu", "--devices", "2"], "GPU"),
    (["--model", "vit_tiny", "--resume", "nowhere/last.ckpt"], "no checkpoint"),
    (["--model", "vit_tiny", "--out", "FILE"], "cannot write"),
])
def test_user_errors_in_process(extra, message, slice_args, tmp_path, capsys):
    (tmp_path / "FILE").write_text("")
    extra = [str(tmp_path / a) if a == "FILE" else a for a in extra]
    out_dir = [] if "--out" in extra else ["--out", str(tmp_path)]
    code, out, err = run_main([*extra, *out_dir, *slice_args], capsys)
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("case", ["unknown_model", "missing_data", "wrong_layout"])
def test_user_errors_with_the_data(case, tmp_path, capsys):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"")
    args, message = {
        "unknown_model": (["--model", "vit_tiyn"], "vit_tiny"),
        "missing_data": (["--model", "vit_nano", "--data-dir", str(tmp_path / "none")], "none"),
        "wrong_layout": (["--model", "vit_nano", "--data-dir", str(tmp_path / "flat")], "train"),
    }[case]
    code, out, err = run_main([*args, "--out", str(tmp_path / "runs")], capsys)
    assert code == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err[-2000:]
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("flag", [["--compile"], ["--compile", "step"]])
def test_compile_flag_trains(flag, slice_args, tmp_path, capsys):
    """--compile wraps the model in torch.compile, --compile step the training step (inductor takes ~30 s to
    compile on this CPU: slow)."""
    args = ["--config", str(REPO / "configs" / "test_tiny.yaml"), *flag, "--out", str(tmp_path), *slice_args]
    code, out, err = run_main(args, capsys)
    assert code == 0, err[-2000:]
    summary = json.loads((REPO / out.strip().splitlines()[-1] / "summary.json").read_text())
    assert summary["global_step"] == 2
