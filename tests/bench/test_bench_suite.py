"""The benchmark suite in its quick form (the command documented in BENCHMARKS.md runs the full one). No timing
is asserted here (speeds are results, in BENCHMARKS.md): what is checked is that every section is written with
sane values, that the candidates compared side by side compute the same thing, that the FLOPs behind MFU match
a hand count, and that the memory claims hold: sdpa, chunked and linear attention stay far below the math
backend's quadratic peak."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import report_tables
from benchmarks.results import from_suite
from zoo.bench.suite import attention_candidates, baseline_vit, run_suite, timm_vit_like
from zoo.models import create_model


def vit_forward_flops(img: int, patch: int, dim: int, depth: int, mlp_ratio: int, classes: int,
                      in_chans: int = 3) -> int:
    """Matmul FLOPs (2 per multiply-add) of one image through a class-token ViT, counted by hand: patch
    embedding, then per block qkv, q @ k^T, weights @ v, proj, fc1, fc2, then the head."""
    patches = (img // patch) ** 2
    n = patches + 1
    per_block = n * dim * 3 * dim + 2 * n * n * dim + n * dim * dim + 2 * n * dim * mlp_ratio * dim
    return 2 * (patches * in_chans * patch * patch * dim + depth * per_block + dim * classes)


def test_hand_flop_count_matches_the_published_vit_tiny_figure():
    assert vit_forward_flops(32, 4, 192, 12, 4, 10) == 730_215_168  # results/ model_info, vit_tiny


def test_attention_candidates_share_weights_and_agree():
    candidates = attention_candidates(48, 3)
    x = torch.randn(2, 17, 48)
    with torch.no_grad():
        outputs = {name: m(x) for name, m in candidates.items()}
    torch.testing.assert_close(outputs["timm"], outputs["zoo"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs["floor"], outputs["zoo"], atol=1e-5, rtol=1e-5)


def test_the_timm_model_compared_with_a_zoo_vit_is_the_same_network():
    ours = create_model("vit_nano").eval()  # the suite compares vit_tiny; nano is the same family, faster
    theirs = timm_vit_like(ours).eval()
    assert {k: v.shape for k, v in theirs.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), atol=1e-4, rtol=1e-4)


def test_hybrid_baseline_is_the_vit_of_the_claim():
    vit = baseline_vit()
    assert (vit.embed_dim, len(vit.blocks), vit.patch_embed.patch_size, vit.patch_embed.img_size) == \
           (192, 6, (4, 4), (32, 32))


def positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.mark.slow  # about a minute on 2 CPU cores; the default suite keeps smaller forms
def test_quick_suite_writes_every_section_and_memory_claims_hold(cifar_dir, tmp_path):
    results = run_suite(tmp_path, data_dir=str(cifar_dir), quick=True, device="cpu")
    saved = json.loads((tmp_path / "bench.json").read_text())
    sections = {"machine", "attention_op", "models", "training_speed", "memory", "mfu", "pipeline",
                "precision", "claims"}
    assert set(saved) == sections and set(results) == sections
    markdown = (tmp_path / "bench.md").read_text()
    assert all(f"## {name}" in markdown for name in sections)

    op = saved["attention_op"][0]
    assert op["n"] == 33 and all(positive(op[k]) for k in ("zoo_ms", "timm_ms", "floor_ms", "zoo_vs_floor",
                                                           "zoo_vs_timm"))
    model = saved["models"][0]
    assert model["model"] == "vit_tiny" and all(positive(model[k]) for k in (
        "zoo_train_img_s", "timm_train_img_s", "zoo_infer_img_s", "timm_infer_img_s", "train_ratio",
        "infer_ratio"))
    assert [row["model"] for row in saved["training_speed"]] == ["hybrid_tiny"]

    mfu = saved["mfu"][0]
    assert mfu["forward_flops_per_image"] == vit_forward_flops(32, 4, 192, 12, 4, 10)  # attention included
    assert mfu["train_img_s"] == model["zoo_train_img_s"] and positive(mfu["mfu"])

    memory = {row["backend"]: row for row in saved["memory"]}  # N = 2049: math holds ~50 MB of scores
    for backend in ("sdpa", "chunked", "linear"):
        for phase in ("inference_mb", "backward_mb"):
            assert memory[backend][phase] < memory["math"][phase] / 3, (backend, phase, memory)
    assert positive(saved["pipeline"]["img_s"]) and positive(saved["pipeline"]["vs_fastest_model_training"])

    claims = {row["claim"]: row for row in saved["claims"]}
    assert len(claims) == 9 and all(row["unit"] for row in claims.values())
    gpu_only = [c for c in claims if "less memory" in c and "mixed precision" in c]
    assert [claims[c]["measured"] for c in gpu_only] == [None]  # the CPU's RSS cannot resolve it
    assert all(positive(row["measured"]) for c, row in claims.items() if c not in gpu_only)
    assert any("hybrid_tiny" in c for c in claims)

    record = from_suite(saved, "python -m benchmarks.suite --out OUT")   # as results/ and the report take it
    numbers = record["numbers"]
    four_digits = {"rel": 5e-4}  # a record keeps 4 significant digits
    assert numbers["attention_op"][0] == pytest.approx({k: op[k] for k in ("n", "zoo_ms", "timm_ms", "floor_ms")},
                                                       **four_digits)
    assert [r["zoo"] for r in numbers["whole_model"]] == pytest.approx([model["zoo_train_img_s"],
                                                                        model["zoo_infer_img_s"]], **four_digits)
    assert numbers["mfu"]["mfu"] == pytest.approx(mfu["mfu"], **four_digits)
    assert numbers["pipeline_images_per_s"] == pytest.approx(saved["pipeline"]["img_s"], **four_digits)
    assert "| 33 |" in "\n".join(report_tables.suite_section([record]))
