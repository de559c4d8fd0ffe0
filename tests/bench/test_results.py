"""benchmarks.results: machine facts read from /proc texts (against hand-read values), validation of a record
(each missing or wrong field refused by name), write / read round trips, a training run's summary.json as a
record, and the benchmark mains' conversions of their rows (against hand-built rows)."""

from __future__ import annotations

import json

import pytest
import yaml

from benchmarks import modes, results
from benchmarks import sparse as recorded_sparse
from benchmarks.results import ResultError

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu vme avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 999
model name\t: not the first processor
flags\t\t: fpu
"""
MEMINFO = "MemTotal:       25165824 kB\nMemFree:         1000 kB\n"


def record(**changes) -> dict:
    machine = {"id": "intel-f6-m143", "cpu": "Xeon", "vendor": "intel", "family": 6, "model": 143,
               "flags": {"avx512_bf16": True, "amx": True}, "cores": 2, "threads": 2, "memory_gib": 24, "gpu": None}
    base = {"kind": "train", "title": "t", "machine": machine, "command": "python train.py --model vit_nano",
            "versions": {"python": "3.11", "torch": "2.14.1", "timm": "1.0.31", "lightning": "2.6.6", "zoo": "0.2.0"},
            "date": "2026-12-04",
            "numbers": {"model": "vit_nano", "budget": "00:00:10:00", "setting": "", "precision": "32", "seed": 0,
                        "steps": 10, "train_images_per_s": 1.5, "test_top1": 0.5, "tta": True}}
    base.update(changes)
    return base


def test_machine_facts_read_the_first_processor_of_cpuinfo():
    facts = results.machine_facts(CPUINFO, MEMINFO)
    assert facts["id"].startswith("intel-f6-m143")
    assert (facts["vendor"], facts["family"], facts["model"]) == ("intel", 6, 143)
    assert facts["cpu"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert facts["flags"] == {"avx512_bf16": True, "amx": True}
    assert facts["memory_gib"] == 24   # 25,165,824 kB = 24 GiB


def test_machine_facts_without_bf16_flags():
    text = CPUINFO.replace("avx512_bf16 amx_bf16 amx_tile", "avx2").replace("GenuineIntel", "AuthenticAMD")
    facts = results.machine_facts(text, "")
    assert facts["flags"] == {"avx512_bf16": False, "amx": False} and facts["vendor"] == "amd"
    assert facts["memory_gib"] is None


@pytest.mark.parametrize("change, message", [
    ({"kind": "speed"}, "kind must be one of"),
    ({"date": "4 Dec 2026"}, "date must be YYYY-MM-DD"),
    ({"command": "  "}, "command is empty"),
    ({"numbers": {"model": "vit_nano"}}, "numbers of a train result lack budget"),
    ({"versions": {"torch": "2.14.1"}}, "versions lacks python"),
    ({"kind": "tried", "numbers": {"target": "t", "metric": "m", "budget": "b", "precision": "32",
                                   "rows": [{"change": "c", "with": [0.5], "without": [0.4]}, {"change": "c"}]}},
     r"numbers.rows\[1\] of a tried result lacks with, without"),
])
def test_validate_names_what_is_wrong(change, message):
    with pytest.raises(ResultError, match=message):
        results.validate(record(**change), "x.json")


def test_validate_names_a_missing_field_and_wrong_flags():
    broken = record()
    del broken["command"]
    with pytest.raises(ResultError, match="x.json: missing command"):
        results.validate(broken, "x.json")
    flags = record()
    flags["machine"] = {**flags["machine"], "flags": {"avx512_bf16": True}}
    with pytest.raises(ResultError, match="machine.flags must have exactly avx512_bf16, amx"):
        results.validate(flags)


def test_write_read_round_trip_and_no_overwrite(tmp_path):
    first = results.write(record(), tmp_path)
    assert first.name == "2026-12-04_train_intel-f6-m143_vit_nano-10min-s0.json"
    assert results.read(first) == record()
    assert results.write(record(), tmp_path) == first   # the same measurement again: the same file
    other = record(numbers={**record()["numbers"], "test_top1": 0.6})
    second = results.write(other, tmp_path)
    assert second != first and results.read(second)["numbers"]["test_top1"] == 0.6
    assert sorted(r["numbers"]["test_top1"] for r in results.read_all(tmp_path)) == [0.5, 0.6]


def test_a_long_setting_is_cut_with_a_digest_so_no_name_reads_as_another_value():
    def name(setting: str) -> str:
        return results.file_name(record(numbers={**record()["numbers"], "setting": setting}))

    short = "--set tta=0 --set model_args.patch_drop_rate=0.5"   # 48 characters: kept whole
    assert name(short).endswith("_vit_nano-10min--set-tta=0--set-model_args.patch_drop_rate=0.5-s0.json")
    long = [f"--set tta=0 --set model_args.patch_drop_rate={rate}" for rate in ("0.75", "0.875", "0.5 --set x=1")]
    names = [name(s) for s in long]
    assert len(set(names)) == 3 and not any("rate=0." in n for n in names)   # "=0.75" cut to "=0.7" read wrong
    assert all(len(n) == len(names[0]) for n in names)


def test_write_refuses_a_bad_record_and_writes_nothing(tmp_path):
    with pytest.raises(ResultError):
        results.write(record(date="yesterday"), tmp_path)
    assert not list(tmp_path.glob("*"))


def test_read_names_a_file_that_is_not_json(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ResultError, match="bad.json: not JSON"):
        results.read_all(tmp_path)


def test_from_run_reads_summary_config_and_the_plain_eval(tmp_path):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({
        "model": "hybrid_tiny", "precision": "bf16-mixed", "global_step": 1630, "epochs": 4,
        "train_images_per_s": 378.0, "best_val_top1": 0.887, "test_top1": 0.8789, "optimizer": "muon_conv"}))
    (run / "config.yaml").write_text(yaml.safe_dump({"model": "hybrid_tiny", "max_time": "00:00:10:00", "seed": 1,
                                                     "tta": 2}))
    (run / "eval" / "metrics.json").write_text(json.dumps({"test_top1": 0.8701}))
    n = results.from_run(run, setting="--precision 32")["numbers"]
    assert (n["model"], n["budget"], n["seed"], n["steps"], n["test_top1"], n["tta"], n["test_top1_plain"]) == \
        ("hybrid_tiny", "00:00:10:00", 1, 1630, 0.8789, True, 0.8701)
    timed = results.from_run(run, setting="--precision 32")
    assert "--max-time 00:00:10:00 --seed 1 --precision 32" in timed["command"]
    (run / "config.yaml").write_text(yaml.safe_dump({"model": "hybrid_tiny", "epochs": 12, "seed": 0}))
    untimed = results.from_run(run)
    assert untimed["numbers"]["budget"] == "12 epochs" and "--epochs 12" in untimed["command"]
    with pytest.raises(ResultError, match="not a finished run"):
        results.from_run(tmp_path / "missing")


def test_a_distilled_run_is_recorded_under_its_teacher(tmp_path):
    """A run with a teacher never lands among the plain ten-minute figures (setting ""): its setting names it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "model": "vit_tiny", "precision": "32", "global_step": 500, "epochs": 1, "train_images_per_s": 90.0,
        "best_val_top1": 0.7, "test_top1": 0.71}))
    (run / "config.yaml").write_text(yaml.safe_dump({"model": "vit_tiny", "max_time": "00:00:10:00", "seed": 0,
                                                     "teacher": "pretrained:hybrid_tiny"}))
    record = results.from_run(run)
    assert record["numbers"]["setting"] == "--teacher pretrained:hybrid_tiny"
    assert record["command"].endswith("--seed 0 --teacher pretrained:hybrid_tiny")
    assert results.from_run(run, setting="--teacher pretrained:hybrid_tiny")["numbers"]["setting"] == \
        "--teacher pretrained:hybrid_tiny"
    # as the ablation names it (--set teacher=...): once, not a second time as --teacher
    assert results.from_run(run, setting="--set teacher=pretrained:hybrid_tiny")["numbers"]["setting"] == \
        "--set teacher=pretrained:hybrid_tiny"


def test_cli_records_a_run_and_refuses_a_non_run(tmp_path, capsys):
    assert results.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "r")]) == 2
    assert "not a finished run" in capsys.readouterr().err


def test_modes_rows_become_one_column_per_mode():
    rows = [{"model": "vit_nano", "batch": 128, "infer_img_s": 700.0, "infer_bf16_mixed_img_s": 900.0,
             "fp32_img_s": 200.0, "bf16_true_img_s": 150.0, "bf16_true_vs_fp32": 0.75}]
    optimizer_rows = [{"model": "vit_nano", "precision": "32", "optimizer": o, "muon_dtype": "float32", "vs_adamw": v}
                      for o, v in (("adamw", 1.0), ("muon", 0.9))]
    found, cost = modes.results_records(rows, optimizer_rows, "python -m benchmarks.modes", keep_freed_memory=True)
    assert found["kind"] == "modes" and cost["kind"] == "optimizer_cost"
    assert found["numbers"]["keep_freed_memory"] is cost["numbers"]["keep_freed_memory"] is True
    row = found["numbers"]["rows"][0]
    assert (row["fp32"], row["bf16_true"], row["inference_fp32"], row["inference_bf16_mixed"]) == (200, 150, 700, 900)
    assert cost["numbers"]["rows"] == [{"model": "vit_nano", "precision": "32", "muon_dtype": "float32",
                                        "adamw_vs_adamw": 1.0, "muon_vs_adamw": 0.9}]


def test_sparse_rows_become_one_record_per_mode():
    found = {"rows": [
        {"n": 1024, "window": 16, "mode": "fwd+bwd", "dense_ms": 30.0, "dense_mb": 9.0, "banded_ms": 10.0},
        {"n": 1024, "window": 64, "mode": "fwd+bwd", "banded_ms": 15.0, "banded_mb": 10.0},
        {"n": 1024, "window": 64, "mode": "fwd", "banded_ms": 5.0}],
        "claims": [{"claim": "window ±64 training, auto >= 3x faster", "measured": 8.46, "unit": "x speed (fwd+bwd)"},
                   {"claim": "window ±64 inference, flex >= 3x faster", "measured": 5.6, "unit": "x speed (fwd)"}]}
    training, inference = recorded_sparse.results_records(found, "python -m benchmarks.sparse")
    assert training["numbers"]["rows"] == [{"n": 1024, "dense": {"ms": 30.0, "mib": 9.0},
                                            "banded": {"ms": 15.0, "mib": 10.0}}]   # the ±64 row's banded
    assert [c["measured"] for c in training["numbers"]["claims"]] == ["8.46x"]
    assert inference["numbers"]["rows"] == [{"n": 1024, "banded": {"ms": 5.0, "mib": None}}]
    assert [c["measured"] for c in inference["numbers"]["claims"]] == ["5.6x"]


def test_gpu_check_report_becomes_a_gpu_record(tmp_path):
    from benchmarks import gpu_check

    report = {"dry_run": False, "skipped": ["suite"], "environment": {"ok": True, "memory_gb": 139.0},
              "vit_tiny": {"ok": True, "train_img_s": 5000.0, "run": "runs/x", "seconds": 60.0},
              "speedrun": {"ok": False, "error": "boom", "seconds": 1.0}}
    (found,) = gpu_check.results_records(report, tmp_path, "python -m benchmarks.gpu_check --out OUT")
    assert found["kind"] == "gpu"
    assert found["numbers"]["rows"] == [{"step": "vit_tiny", "measure": "train_img_s", "value": 5000.0},
                                        {"step": "vit_tiny", "measure": "seconds", "value": 60.0}]


def test_command_line_quotes_arguments_and_keeps_the_bf16_switch(monkeypatch):
    monkeypatch.delenv("ZOO_NATIVE_BF16", raising=False)
    assert results.command_line("benchmarks.modes", ["--models", "vit_nano", "--set", "a b"]) == \
        "python -m benchmarks.modes --models vit_nano --set 'a b'"
    monkeypatch.setenv("ZOO_NATIVE_BF16", "0")
    assert results.command_line("benchmarks.muon", []) == "ZOO_NATIVE_BF16=0 python -m benchmarks.muon"
    assert results.command_line("eval.py", ["--bench-suite"]) == "ZOO_NATIVE_BF16=0 python eval.py --bench-suite"


def test_a_recorded_command_names_placeholders_not_the_machines_folders(monkeypatch):
    monkeypatch.delenv("ZOO_NATIVE_BF16", raising=False)
    argv = ["--data-dir", "/home/me/cifar10", "--out=/tmp/x y", "--seeds", "0", "--cache-dir", "c", "--set", "out=1"]
    assert results.command_line("benchmarks.ablation", argv) == (
        "python -m benchmarks.ablation --data-dir DATA --out=OUT --seeds 0 --cache-dir CACHE --set out=1")
    assert results.command_line("benchmarks.anchor", ["--anchor", "../anchors/airbench94_cpu", "--seeds", "0"]) == (
        "python -m benchmarks.anchor --anchor ANCHOR_DIR --seeds 0")


def test_significant_rounds_every_float_to_four_digits_and_leaves_the_rest():
    numbers = {"rows": [{"model": "vit_tiny", "fp32": 281.7199415348926, "steps": 2601, "ok": True,
                         "ci": [0.2919876, 0.00012345678]}], "note": None}
    assert results.significant(numbers) == {"rows": [{"model": "vit_tiny", "fp32": 281.7, "steps": 2601, "ok": True,
                                                      "ci": [0.292, 0.0001235]}], "note": None}
