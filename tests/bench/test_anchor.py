"""benchmarks.anchor pairs the zoo's CPU recipe with the airbench94 port: the anchor's epochs fill the budget by its
own bench (checked against the arithmetic by hand), the sides alternate by seed, the anchor runs with the zoo's
malloc settings and the chosen precision, a stopped pairing resumes without rerunning a finished side, and the
records it writes are valid results. The anchor here is a stand-in script with the real one's command line; the
zoo's side is a stand-in run directory."""

import json
import math
import textwrap
from pathlib import Path

import pytest
import yaml

from benchmarks import anchor, results

FAKE_ANCHOR = textwrap.dedent("""
    import argparse, json, os, sys
    p = argparse.ArgumentParser()
    for flag in ("--data", "--jsonl", "--tag"):
        p.add_argument(flag)
    for flag in ("--bench_steps", "--seed", "--bf16"):
        p.add_argument(flag, type=int, default=0)
    p.add_argument("--epochs", type=float, default=9.9)
    args = p.parse_args()
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        f.write(json.dumps({**vars(args), "trim": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
                            "mmap": os.environ.get("MALLOC_MMAP_THRESHOLD_")}) + "\\n")
    if args.bench_steps:
        res = {"bench": True, "img_per_s": 500.0}
    else:
        res = {"steps": int(args.epochs * 49), "train_img_per_s": 480.0, "tta_val_acc": 0.80 + args.seed / 100,
               "val_acc": 0.79 + args.seed / 100, "wall_seconds": 560.0}
    print("noise"); print("RESULT " + json.dumps(res))
""")
FAKE_PREP = textwrap.dedent("""
    import argparse, os
    p = argparse.ArgumentParser(); p.add_argument("--out"); p.add_argument("--limit", type=int)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for split in ("train", "test"):
        open(os.path.join(args.out, split + ".pt"), "w").write(os.environ["CIFAR_DIR"])
""")


def test_anchor_epochs_fill_the_budget_by_hand():
    # 500 img/s: evaluation 7 passes x 10,000 images at 3 x 500 img/s = 46.67 s; (570 - 46.67) x 500 / 50,000
    assert anchor.anchor_epochs(500.0, 570.0) == 5.2
    # 100 img/s: 233.3 s of evaluation; (570 - 233.3) x 100 / 50,000 = 0.67
    assert anchor.anchor_epochs(100.0, 570.0) == 0.6
    with pytest.raises(ValueError, match="--anchor-seconds"):
        anchor.anchor_epochs(40.0, 570.0)  # 583 s of evaluation alone


def test_sides_alternate_by_seed():
    assert [anchor.order(s)[0] for s in range(4)] == ["zoo", "anchor", "zoo", "anchor"]
    assert all(sorted(anchor.order(s)) == ["anchor", "zoo"] for s in range(4))


def test_pairing_table_means_and_standard_errors():
    rows = [{"seed": s, "side": side, "test_top1_tta": v, "test_top1_plain": v - 0.01, "epochs": 5.2}
            for s, (z, a) in enumerate([(0.88, 0.87), (0.90, 0.86), (0.86, 0.87)])
            for side, v in (("zoo", z), ("anchor", a))]
    table = anchor.pairing_table(rows)
    diffs = [0.01, 0.04, -0.01]
    mean = sum(diffs) / 3
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2) / math.sqrt(3)  # sample sd / sqrt(n)
    assert f"zoo - anchor, paired by seed: 0.0133 ± {se:.4f} (pairs=3)" in table
    assert "zoo: test top-1 with TTA 0.8800 ± 0.0115 (n=3)" in table  # sd 0.02 / sqrt(3)
    assert "| 1 | 0.9000 / 0.8900 | 0.8600 / 0.8500 | 5.2 | +0.0400 |" in table


def fake_zoo_run(tmp_path: Path):
    def run(seed, args):
        run_dir = tmp_path / "runs" / f"s{seed}"
        run_dir.mkdir(parents=True, exist_ok=True)
        summary = {"model": args.model, "precision": args.precision, "global_step": 100, "epochs": 3,
                   "train_images_per_s": 250.0, "test_top1": 0.85, "best_val_top1": 0.84, "optimizer": "adamw",
                   "wall_time_s": 540.0}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        (run_dir / "config.yaml").write_text(yaml.safe_dump({"max_time": args.max_time, "seed": seed, "tta": 2}))
        return {"seed": seed, "side": "zoo", "model": args.model, "precision": args.precision, "epochs": 3,
                "steps": 100, "train_images_per_s": 250.0, "test_top1_tta": 0.85, "test_top1_plain": 0.84,
                "seconds": 540.0, "run": str(run_dir)}
    return run


def test_pairing_runs_both_sides_alternating_and_resumes(tmp_path, monkeypatch):
    folder = tmp_path / "anchor"
    folder.mkdir()
    (folder / "airbench94_cpu.py").write_text(FAKE_ANCHOR)
    (folder / "prep_data.py").write_text(FAKE_PREP)
    monkeypatch.setattr(anchor, "zoo_row", fake_zoo_run(tmp_path))
    argv = ["--anchor", str(folder), "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
            "--seeds", "0", "1", "--precision", "bf16-mixed", "--results", str(tmp_path / "results")]
    assert anchor.main(argv) == 0
    calls = [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]
    assert [c["bench_steps"] for c in calls] == [6, 0, 0]  # one bench, then a run per seed
    assert all(c["bf16"] == 1 for c in calls)  # the pairing's precision
    assert [c["epochs"] for c in calls[1:]] == [5.2, 5.2] and [c["seed"] for c in calls[1:]] == [0, 1]
    assert {(c["trim"], c["mmap"]) for c in calls} == {(str(2**31 - 1), str(32 << 20))}  # zoo's malloc settings
    assert (tmp_path / "out" / "anchor_data" / "train.pt").read_text() == str((tmp_path / "data").resolve())
    rows = anchor.ablation.read_rows(tmp_path / "out" / "anchor.csv")
    assert [(r["seed"], r["side"]) for r in rows] == [(0, "zoo"), (0, "anchor"), (1, "anchor"), (1, "zoo")]
    records = results.read_all(tmp_path / "results")  # validated
    assert sorted(r["numbers"]["model"] for r in records) == ["airbench94", "airbench94", "hybrid_tiny",
                                                              "hybrid_tiny"]
    ab = [r["numbers"] for r in records if r["numbers"]["model"] == "airbench94"]
    assert sorted(n["test_top1"] for n in ab) == [0.80, 0.81] and {n["epochs"] for n in ab} == {5.2}
    assert anchor.main(argv) == 0  # everything done: only the bench runs again
    assert len((folder / "calls.jsonl").read_text().splitlines()) == 4


def test_missing_anchor_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        anchor.main(["--anchor", str(tmp_path), "--data-dir", str(tmp_path), "--out", str(tmp_path / "o")])
    assert stop.value.code == 2 and "no airbench94_cpu.py there" in capsys.readouterr().err


def test_precision_other_than_the_anchors_is_refused():
    assert anchor.anchor_precision("32") == 0 and anchor.anchor_precision("bf16-mixed") == 1
    with pytest.raises(ValueError, match="32 or bf16-mixed"):
        anchor.anchor_precision("16-mixed")


def test_default_precision_follows_the_detection(monkeypatch):
    monkeypatch.setenv("ZOO_NATIVE_BF16", "0")
    assert anchor.default_precision() == "32"
    monkeypatch.setenv("ZOO_NATIVE_BF16", "1")
    assert anchor.default_precision() == "bf16-mixed"


def test_a_bad_zoo_setting_stops_before_the_anchor_runs(tmp_path, capsys):
    folder = tmp_path / "anchor"
    folder.mkdir()
    (folder / "airbench94_cpu.py").write_text(FAKE_ANCHOR)
    with pytest.raises(SystemExit) as stop:
        anchor.main(["--anchor", str(folder), "--data-dir", str(tmp_path), "--out", str(tmp_path / "o"),
                     "--precision", "32", "--set", "lr=-1"])
    assert stop.value.code == 2 and "--set precision=32 --set lr=-1: " in capsys.readouterr().err
    assert not (folder / "calls.jsonl").exists() and not (tmp_path / "o").exists()  # nothing ran or was made


def test_a_failed_run_ends_the_pairing_in_one_line(tmp_path, monkeypatch, capsys):
    import subprocess

    folder = tmp_path / "anchor"
    folder.mkdir()
    (folder / "airbench94_cpu.py").write_text(FAKE_ANCHOR)
    (folder / "prep_data.py").write_text(FAKE_PREP)

    def failing(seed, args):
        raise subprocess.CalledProcessError(2, ["train.py"])

    monkeypatch.setattr(anchor, "zoo_row", failing)
    code = anchor.main(["--anchor", str(folder), "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "o"),
                        "--seeds", "0", "--precision", "32"])
    assert code == 2 and "the zoo run of seed 0 stopped (exit 2" in capsys.readouterr().err
