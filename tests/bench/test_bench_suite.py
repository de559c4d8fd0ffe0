"""The benchmark suite in its quick form (the command documented in BENCHMARKS.md runs the full one): every
section is written, ratios are computed from the measured times, and the memory claims that are not timings
hold: sdpa, chunked and linear attention stay far below the math backend's quadratic peak."""

from __future__ import annotations

import json

from zoo.bench.suite import run_suite


def test_quick_suite_writes_every_section_and_memory_claims_hold(cifar_dir, tmp_path):
    results = run_suite(tmp_path, data_dir=str(cifar_dir), quick=True, device="cpu")
    saved = json.loads((tmp_path / "bench.json").read_text())
    sections = {"machine", "attention_op", "models", "training_speed", "memory", "mfu", "pipeline",
                "precision", "claims"}
    assert set(saved) == sections and set(results) == sections
    markdown = (tmp_path / "bench.md").read_text()
    assert all(f"## {name}" in markdown for name in sections)

    op = saved["attention_op"][0]
    assert op["zoo_vs_floor"] == op["zoo_ms"] / op["floor_ms"]
    model = saved["models"][0]
    assert model["train_ratio"] == model["zoo_train_img_s"] / model["timm_train_img_s"]
    assert 0 < saved["mfu"][0]["mfu"] < 1.5

    memory = {row["backend"]: row for row in saved["memory"]}  # N = 2049: math holds ~50 MB of scores
    for backend in ("sdpa", "chunked", "linear"):
        for phase in ("inference_mb", "backward_mb"):
            assert memory[backend][phase] < memory["math"][phase] / 3, (backend, phase, memory)
    assert saved["pipeline"]["vs_fastest_model_training"] > 10
