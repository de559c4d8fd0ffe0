"""The recipe's ablation (benchmarks.ablation) without training: each variant is the recipe with only its own
keys changed, the command line is the goal's, the table's means and paired differences match a hand
computation, and a finished (variant, seed) is read back so a stopped ablation resumes."""

from __future__ import annotations

import csv
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks import ablation
from zoo.atomic import atomic_write_csv
from zoo.train.recipe import parse_set, resolve_config

CONFIG = str(Path(__file__).parents[2] / "configs" / "cpu_budget.yaml")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and key == "augment":
            out.update(_flat(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("variant", [v for v in ablation.VARIANTS if v != "recipe"])
def test_each_variant_changes_only_its_own_keys(variant):
    # patch dropout and progressive resizing (dynamic_img_size): the ViTs' own
    model = "vit_tiny" if variant.startswith(("patch_drop", "low_res")) else "hybrid_tiny"
    base = _flat(asdict(resolve_config(model, CONFIG)))
    changed = _flat(asdict(resolve_config(model, CONFIG, overrides=ablation.VARIANTS[variant])))
    differing = {key for key in base if base[key] != changed[key]}
    assert differing == set(_flat(parse_set(list(ablation.VARIANTS[variant]))))


def test_train_command_is_the_goals_command_with_the_variants_overrides(tmp_path):
    cmd = ablation.train_command("sgd_nesterov", 1, model="hybrid_tiny", config="configs/cpu_budget.yaml",
                                 data_dir="D", max_time="00:00:10:00", runs=tmp_path)
    args = cmd[3:]  # after python -c <program>
    assert args[:10] == ["--model", "hybrid_tiny", "--config", "configs/cpu_budget.yaml", "--data-dir", "D",
                         "--max-time", "00:00:10:00", "--seed", "1"]
    assert args[args.index("--out") + 1] == str(tmp_path)
    assert [args[i + 1] for i, a in enumerate(args) if a == "--set"] == list(ablation.VARIANTS["sgd_nesterov"])


def _row(variant, seed, tta, plain, steps=100):
    return {"variant": variant, "seed": seed, "run_dir": f"r/{variant}{seed}", "steps": steps,
            "train_images_per_s": 1.0, "best_val_top1": 0.5, "test_top1_tta": tta, "test_top1_plain": plain}


def test_table_means_and_paired_differences_match_a_hand_computation(tmp_path):
    rows = [_row("recipe", 0, 0.84, 0.82), _row("recipe", 1, 0.86, 0.83),
            _row("no_ema", 0, 0.80, 0.79), _row("no_ema", 1, 0.83, 0.80, steps=200)]
    table = ablation.ablation_table(rows)
    recipe_line = next(line for line in table.splitlines() if line.startswith("| recipe |"))
    no_ema_line = next(line for line in table.splitlines() if line.startswith("| no_ema |"))
    assert "| 0, 1 | 0.8400, 0.8600 | 0.8500 |" in recipe_line
    # paired: (0.80 - 0.84 + 0.83 - 0.86) / 2 = -0.035 with TTA, (0.79 - 0.82 + 0.80 - 0.83) / 2 = -0.03 without
    assert "| 0.8150 | -0.0350 | 0.7950 | -0.0300 | 150 |" in no_ema_line
    assert "+0.0250" in table  # TTA on the recipe: (0.02 + 0.03) / 2
    assert "no_whitening" not in table  # variants without runs have no row

    path = tmp_path / "ablation.csv"
    atomic_write_csv(path, ablation.FIELDS, rows)  # as the command writes it
    with path.open(newline="") as f:  # a plain CSV with the header first
        assert next(csv.reader(f)) == list(ablation.FIELDS)
    read = ablation.read_rows(path)
    assert [(r["variant"], r["seed"]) for r in read] == [("recipe", 0), ("recipe", 1), ("no_ema", 0), ("no_ema", 1)]
    assert ablation.ablation_table(read) == table


def test_the_plain_evaluation_goes_where_eval_py_writes_inside_a_run(tmp_path):
    from zoo.explain.report import check_out_dir

    run_dir = tmp_path / "runs" / "hybrid_tiny" / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model: hybrid_tiny\n")
    check_out_dir(ablation.eval_dir(run_dir))  # accepted: the run's own eval/ folder
    with pytest.raises(ValueError):
        check_out_dir(run_dir / "plain")


@pytest.mark.parametrize("tta", [0, 2])
def test_a_run_tested_without_tta_is_not_evaluated_again(tmp_path, monkeypatch, tta):
    """With ``--set tta=0`` the run's own test is the plain number: eval.py runs only where the test used TTA."""
    import argparse
    import json
    import subprocess

    run_dir = tmp_path / "runs" / "vit_tiny" / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"model: vit_tiny\ntta: {tta}\n")
    (run_dir / "summary.json").write_text(json.dumps({
        "precision": "32", "global_step": 7, "train_images_per_s": 1.0, "best_val_top1": 0.3, "test_top1": 0.25,
        "tested_checkpoint": "last.ckpt"}))
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        if "--checkpoint" in cmd:  # eval.py: writes the plain top-1 where the ablation reads it
            (run_dir / "eval").mkdir()
            (run_dir / "eval" / "metrics.json").write_text(json.dumps({"test_top1": 0.2}))
        return subprocess.CompletedProcess(cmd, 0, stdout=f"{run_dir}\n")

    monkeypatch.setattr(ablation.subprocess, "run", fake_run)
    args = argparse.Namespace(model="vit_tiny", config=CONFIG, data_dir="DATA", max_time="00:00:10:00",
                              out=tmp_path, set=[f"tta={tta}"])
    row = ablation.run_one("recipe", 0, args)
    assert len(calls) == (2 if tta else 1)
    assert (row["test_top1_tta"], row["test_top1_plain"]) == ((0.25, 0.2) if tta else (0.25, 0.25))


@pytest.mark.parametrize("argv, message", [
    (["--set", "ema_decay=2"], r"--set ema_decay=2: ema_decay must lie in \[0, 1\)"),
    (["--variants", "recipe", "low_res"], "low_res_size=16 .*: hybrid_tiny takes no argument model_args.dynamic"),
])
def test_a_bad_setting_stops_the_ablation_before_its_first_run(tmp_path, monkeypatch, capsys, argv, message):
    """Every run's settings are resolved first: a bad one (here the second variant's) is one line and exit 2
    before any run has trained."""
    import re

    monkeypatch.setattr(ablation, "run_one", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as stop:
        ablation.main(["--data-dir", "DATA", "--out", str(tmp_path / "out"), "--seeds", "0", "--config", CONFIG,
                       *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and re.search(message, err) and "Traceback" not in err


def test_a_run_that_fails_ends_the_ablation_in_one_line_keeping_the_finished_runs(tmp_path, monkeypatch, capsys):
    """The second variant's train.py exits 2: the ablation says which run stopped and where the finished ones are,
    exits 2 without a traceback, and its table keeps the first run's row."""
    import json
    import subprocess

    def fake_run(cmd, **kwargs):
        if "ema_decay=0" in cmd:
            raise subprocess.CalledProcessError(2, cmd)
        run_dir = tmp_path / "runs" / "recipe"
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text("model: hybrid_tiny\ntta: 0\n")
        (run_dir / "summary.json").write_text(json.dumps({
            "precision": "32", "global_step": 7, "train_images_per_s": 1.0, "best_val_top1": 0.3,
            "test_top1": 0.25, "tested_checkpoint": "last.ckpt"}))
        return subprocess.CompletedProcess(cmd, 0, stdout=f"{run_dir}\n")

    monkeypatch.setattr(ablation.subprocess, "run", fake_run)
    out = tmp_path / "out"
    code = ablation.main(["--data-dir", "DATA", "--out", str(out), "--seeds", "0", "--config", CONFIG,
                          "--variants", "recipe", "no_ema", "--set", "tta=0"])
    err = capsys.readouterr().err
    assert code == 2 and "the no_ema run of seed 0 stopped (exit 2" in err and str(out / "ablation.csv") in err
    assert [r["variant"] for r in ablation.read_rows(out / "ablation.csv")] == ["recipe"]
