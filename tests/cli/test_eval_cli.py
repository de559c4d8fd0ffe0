"""eval.py and zoo.explain.report on a tiny real run made by train.py on real CIFAR-10 images: the files and
their shapes, metrics against Lightning's own test loop, a two-run comparison, and one-line errors.
(zoo.bench's measurements are tested in tests/bench.)"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import slow_except

from zoo.explain.report import most_confused
from zoo.models import model_card, shipped_models

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("eval_cli", REPO / "eval.py")
eval_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_cli)


def test_eval_writes_metrics_figures_maps_and_deletion(tiny_run, tmp_path, capsys):
    out = tmp_path / "eval"
    assert eval_cli.main(["--checkpoint", str(tiny_run), "--out", str(out), "--max-test-images", "32",
                          "--batch-size", "16", "--attention", "--num-images", "1", "--deletion",
                          "--deletion-images", "4"]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    summary = json.loads((tiny_run / "summary.json").read_text())
    # the same checkpoint on the same 32 test images as Lightning's test loop in train.py
    assert metrics["num_images"] == 32
    assert metrics["test_top1"] == pytest.approx(summary["test_top1"])
    assert metrics["test_top5"] == pytest.approx(summary["test_top5"])
    assert list(metrics["per_class_accuracy"]) == summary["class_names"]
    assert all(0.0 <= v <= 1.0 for v in metrics["per_class_accuracy"].values())
    assert "most confused" in printed and f"{metrics['test_top1']:.4f}" in printed
    for pair in metrics["most_confused"]:
        assert pair["true"] != pair["predicted"] and pair["count"] >= 1
    assert (out / "confusion_matrix.png").stat().st_size > 10_000
    maps = np.load(out / "attention" / "maps_000.npy")
    assert maps.shape == (6, 4, 65, 65)  # vit_nano: depth 6, 4 heads, 1 + 8x8 tokens
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5)  # softmax rows
    assert {p.name for p in (out / "attention").glob("*.png")} == {"maps_000.png", "explain_000.png"}
    deletion = json.loads((out / "deletion.json").read_text())
    assert deletion["num_images"] == 4 and len(deletion["fractions"]) == 10
    assert set(deletion["curves"]) == {"rollout", "attention", "random"}
    assert (out / "deletion.png").is_file()


def test_compare_two_runs(tiny_run, tmp_path, monkeypatch):
    first, second = tmp_path / "vit_nano" / "first-run", tmp_path / "vit_nano" / "second-run"
    shutil.copytree(tiny_run, first)
    shutil.copytree(tiny_run, second)
    # what eval already measured into a run dir is reused as is; what is missing is computed
    (first / "benchmark.json").write_text(json.dumps({"inference_images_per_s": 456.0}))
    (second / "deletion.json").write_text(json.dumps({
        "explanation": "rollout", "auc": {"rollout": 0.123, "random": 0.456}}))
    from zoo.explain.leaderboard import write_csv

    write_csv([{"model": "vit_nano", "method": method, "removal": "zero", "metric": "deletion", "auc": auc,
                "ci_low": auc - 0.01, "ci_high": auc + 0.01, "p_vs_random": p, "p_vs_rollout": math.nan,
                "num_images": 20}
               for method, auc, p in (("rollout", 0.3, 0.4), ("chefer2021", 0.2, 0.001), ("random", 0.1, math.nan))],
              second / "faithfulness.csv")  # the best method is named whatever the row label says
    from zoo.explain import compare

    batches, measure = [], compare.measure_inference
    monkeypatch.setattr(compare, "measure_inference", lambda *a, **k: batches.append(a[2]) or measure(*a, **k))
    out = tmp_path / "compare"
    assert eval_cli.main(["--compare", str(first), str(second), "--out", str(out), "--batch-size", "16",
                          "--deletion-images", "4"]) == 0
    with (out / "compare.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert batches == [16]  # only the run without a benchmark.json is timed, at --batch-size
    summary = json.loads((tiny_run / "summary.json").read_text())
    for row in rows:
        assert int(row["params"]) == summary["params"] and float(row["test_top1"]) == summary["test_top1"]
    assert float(rows[0]["inference_images_per_s"]) == 456.0 and float(rows[1]["inference_images_per_s"]) > 0
    assert float(rows[1]["deletion_auc"]) == 0.123 and float(rows[1]["deletion_auc_random"]) == 0.456
    assert 0.0 <= float(rows[0]["deletion_auc"]) <= 0.9
    assert rows[0]["faithfulness_best"] == ""
    assert rows[1]["faithfulness_best"] == "chefer2021 (deletion AUC 0.200, zero removal, p vs random 0.001, 20 images)"
    assert "| model |" in (out / "compare.md").read_text()
    assert "no-grad forwards of 16 random images (--batch-size)" in (out / "compare.md").read_text()
    assert (out / "accuracy_vs_throughput.png").is_file() and (out / "rollout_grid.png").is_file()


def test_bad_inputs_exit_2_with_one_line(tiny_run, tmp_path, capsys):
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes((tiny_run / "checkpoints" / "best.ckpt").read_bytes()[:1000])
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    cases = [["--checkpoint", str(tmp_path / "missing.ckpt")], ["--checkpoint", str(truncated)],
             ["--checkpoint", str(foreign)], ["--checkpoint", str(empty_run)],
             ["--checkpoint", str(tiny_run), "--data-dir", str(tmp_path / "no-data")],
             ["--pretrained", "vit_tiny"], ["--pretrained", "no_such_model"]]
    for args in cases:
        assert eval_cli.main([*args, "--out", str(tmp_path / "out")]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("eval.py: error: "), err


def _faithfulness(tiny_run, out, *flags) -> list[dict]:
    assert eval_cli.main(["--faithfulness", str(tiny_run), "--out", str(out), "--batch-size", "64", *flags]) == 0
    with (out / "faithfulness.csv").open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == ("model", "method", "removal", "metric", "auc", "ci_low", "ci_high",
                                            "p_vs_random", "p_vs_rollout", "num_images", "p_vs_baselines")
        return list(reader)


def test_faithfulness_leaderboard(tiny_run, tmp_path, capsys):
    from zoo.explain import applicable_methods
    from zoo.models import load_run

    methods = applicable_methods(load_run(tiny_run)[0])
    assert methods == ["raw_attention", "rollout", "grad_rollout", "chefer2021", "attnlrp", "gradcam", "random",
                       "centre", "edges"]
    out = tmp_path / "faithfulness"
    rows = _faithfulness(tiny_run, out, "--faithfulness-images", "8", "--sanity")
    assert "Best method: **" in capsys.readouterr().out
    assert {(r["method"], r["removal"], r["metric"]) for r in rows} == {
        (m, "zero", metric) for m in methods for metric in ("deletion", "insertion")} and len(rows) == 18
    for row in rows:
        assert row["model"] == "vit_nano" and row["num_images"] == "8"
        assert float(row["ci_low"]) <= float(row["auc"]) <= float(row["ci_high"])
        assert (row["p_vs_random"] == "nan") == (row["method"] == "random")
        assert (row["p_vs_rollout"] == "nan") == (row["method"] in ("rollout", "random"))
        assert (row["p_vs_baselines"] == "nan") == (row["method"] in ("random", "centre", "edges"))
    md = (out / "faithfulness.md").read_text()
    assert "## vit_nano (8 test images)" in md and md.count("(best)") == 2 and "Sanity check (Adebayo" in md
    assert "| method | head | norm | blocks.5 |" in md
    for name in ("faithfulness_curves_vit_nano.png", "faithfulness_maps_vit_nano.png"):
        assert (out / name).stat().st_size > 10_000


@pytest.mark.slow  # a second report; the default suite's board is the one above
def test_faithfulness_full_grid(tiny_run, tmp_path):
    full = _faithfulness(tiny_run, tmp_path / "full", "--faithfulness-images", "4", "--full-grid",
                         "--absolute-scale", "--methods", "rollout,attnlrp")
    assert {(r["method"], r["removal"], r["metric"]) for r in full} == {
        (m, removal, metric) for m in ("rollout", "attnlrp", "random", "centre", "edges")
        for removal in ("zero", "blur", "mean", "road") for metric in ("deletion", "insertion")} and len(full) == 40
    assert {r["num_images"] for r in full} == {"4"}


def test_faithfulness_refuses_a_method_that_does_not_apply(tiny_run, tmp_path, capsys):
    assert eval_cli.main(["--faithfulness", str(tiny_run), "--out", str(tmp_path / "f"),
                          "--methods", "attnlrp,cbam_gate"]) == 2  # a ViT has no CBAM gate
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'cbam_gate' does not apply to VisionTransformer; the methods that apply: " in err
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("name", slow_except(shipped_models(), ("hybrid_tiny",)))
def test_eval_pretrained_needs_no_run(name, cifar_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    assert eval_cli.main(["--pretrained", name, "--data-dir", str(cifar_dir), "--out", str(out),
                          "--max-test-images", "300", "--attention", "--num-images", "1"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["model"] == name and metrics["num_images"] == 300
    assert metrics["test_top1"] == pytest.approx(model_card(name)["test_top1"], abs=0.08)  # 300 images: ~3.5 s.e.
    assert (out / "attention").is_dir()


def test_most_confused_pairs():
    matrix = torch.tensor([[5, 3, 0], [1, 7, 0], [0, 4, 2]])
    assert most_confused(matrix, ["a", "b", "c"], top=5) == [
        {"true": "c", "predicted": "b", "count": 4, "fraction": 4 / 6},
        {"true": "a", "predicted": "b", "count": 3, "fraction": 3 / 8},
        {"true": "b", "predicted": "a", "count": 1, "fraction": 1 / 8},
    ]


@pytest.mark.slow  # trains a CNN first; the default suite compares two attention runs (test_compare_two_runs)
def test_a_model_without_attention_is_compared_beside_the_attention_models(tiny_run, cifar_dir, tmp_path, capsys):
    """A CNN has no attention to roll out: the comparison still writes its table and grid (its row: no map)."""
    spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    assert train.main(["--model", "resnet18", "--data-dir", str(cifar_dir), "--epochs", "1", "--max-train-images",
                       "64", "--max-test-images", "16", "--limit-train-batches", "1", "--limit-val-batches", "1",
                       "--batch-size", "16", "--set", "val_size=16", "--out", str(tmp_path / "runs"),
                       "--cache-dir", str(tmp_path / "cache")]) == 0
    cnn = Path(capsys.readouterr().out.strip().splitlines()[-1])
    out = tmp_path / "compare"
    assert eval_cli.main(["--compare", str(tiny_run), str(cnn), "--out", str(out), "--batch-size", "16",
                          "--deletion-images", "4", "--cache-dir", str(tmp_path / "cache")]) == 0
    with (out / "compare.csv").open() as f:
        assert [row["model"].split()[0] for row in csv.DictReader(f)] == ["vit_nano", "resnet18"]
    assert (out / "rollout_grid.png").stat().st_size > 0


def test_sources_of_one_model_get_labels_apart():
    from zoo.explain.faithfulness_report import source_labels

    assert source_labels(["a/x/last.ckpt", "runs/y", "pretrained:hybrid_tiny"], ["vit_nano", "vit_nano",
                                                                                "hybrid_tiny"]) == [
        "vit_nano (last.ckpt)", "vit_nano (y)", "hybrid_tiny"]
    assert source_labels(["a/checkpoints/last.ckpt", "b/checkpoints/last.ckpt"], ["vit_nano"] * 2) == [
        "vit_nano (a/checkpoints/last.ckpt)", "vit_nano (b/checkpoints/last.ckpt)"]


def test_a_class_with_no_tested_image_has_no_accuracy(cifar_dir, tmp_path):
    """5 test images hold at most 5 of the 10 classes: the others' accuracy is null, not 0.0 (valid JSON)."""
    out = tmp_path / "eval"
    assert eval_cli.main(["--pretrained", "vit_nano", "--data-dir", str(cifar_dir), "--max-test-images", "5",
                          "--out", str(out), "--cache-dir", str(tmp_path / "cache")]) == 0
    text = (out / "metrics.json").read_text()
    per_class = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in metrics.json"))[
        "per_class_accuracy"]
    tested = {name: value for name, value in per_class.items() if value is not None}
    assert 1 <= len(tested) <= 5 and all(0.0 <= value <= 1.0 for value in tested.values())


def test_every_one_device_mode_runs_on_rank_zero_under_torchrun(monkeypatch, capsys):
    from zoo.explain import cli

    for name, value in dict(RANK="0", LOCAL_RANK="0", GROUP_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                            TORCHELASTIC_RUN_ID="x", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555").items():
        monkeypatch.setenv(name, value)
    for mode in (["--compare", "a", "b"], ["--faithfulness", "a"], ["--report", "pretrained:vit_nano"],
                 ["--bench-suite"]):
        assert cli.one_device_under_launcher(cli.parse_args([*mode, "--out", "o"])) is None
        assert f"eval.py {mode[0]} runs on one device: rank 0 runs it" in capsys.readouterr().out


def test_compare_says_the_test_images_and_an_unfinished_run_and_counts_its_size(tiny_run, tmp_path, capsys):
    """A run stopped before its recipe's end has no summary.json: its row says it is unfinished (its checkpoint's
    epoch and step against the recipe's epochs), on how many test images its top-1 was measured (the same as
    eval.py --checkpoint on that many), and its params / FLOPs (the finished run's, as train.py counted them)."""
    import yaml

    unfinished = tmp_path / "vit_nano" / "unfinished"
    shutil.copytree(tiny_run, unfinished)
    (unfinished / "summary.json").unlink()
    config = yaml.safe_load((unfinished / "config.yaml").read_text())
    (unfinished / "config.yaml").write_text(yaml.safe_dump({**config, "epochs": 3}))
    out = tmp_path / "compare"
    assert eval_cli.main(["--compare", str(tiny_run), str(unfinished), "--out", str(out), "--batch-size", "16",
                          "--deletion-images", "4"]) == 0
    with (out / "compare.csv").open() as f:
        finished_row, unfinished_row = csv.DictReader(f)
    summary = json.loads((tiny_run / "summary.json").read_text())
    ckpt = torch.load(unfinished / "checkpoints" / "best.ckpt", map_location="cpu", weights_only=False)
    assert finished_row["training"] == "finished" and int(finished_row["test_images"]) == 32  # train.py's test
    assert unfinished_row["training"] == (f"unfinished (checkpoint at epoch {ckpt['epoch'] + 1} of 3, "
                                          f"step {ckpt['global_step']})")
    assert int(unfinished_row["params"]) == summary["params"] and int(unfinished_row["flops"]) == summary["flops"]
    tested = int(unfinished_row["test_images"])
    assert tested == 6  # the compared images: max(--deletion-images, the grid's 6)
    assert eval_cli.main(["--checkpoint", str(unfinished), "--out", str(tmp_path / "eval"), "--max-test-images",
                          str(tested)]) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert float(unfinished_row["test_top1"]) == pytest.approx(metrics["test_top1"])
    table = (out / "compare.md").read_text()
    assert "| unfinished (checkpoint at epoch" in table and "test_images" in table


def test_attention_writes_an_index_of_its_files(cifar_dir, tmp_path):
    """--attention's files (a figure, attention grid and arrays per image, CBAM gates) are linked from one
    index.html that shows each image's figure; every link leads to a file, every file is linked."""
    import re

    out = tmp_path / "eval"
    assert eval_cli.main(["--pretrained", "hybrid_tiny", "--data-dir", str(cifar_dir), "--out", str(out),
                          "--max-test-images", "20", "--attention", "--num-images", "2",
                          "--cache-dir", str(tmp_path / "cache")]) == 0
    folder = out / "attention"
    page = (folder / "index.html").read_text()
    linked = set(re.findall(r'(?:src|href)="([^"]+)"', page))
    files = {p.name for p in folder.iterdir()} - {"index.html"}
    assert linked == files and {"explain_000.png", "explain_001.png", "cbam_001_stage1.npy"} <= files
    assert re.findall(r'<img src="([^"]+)"', page) == ["explain_000.png", "explain_001.png"]
