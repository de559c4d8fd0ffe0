"""Distillation (``--teacher``) against hand formulas: DeiT's hard term is cross-entropy on the teacher's top
class, the soft term KL(teacher || student) at temperature T times T**2 over the logits' element count; the
student's loss mixes its own with the term by ``distill_weight``, its gradient is that of the hand-mixed loss, and
the teacher stays frozen and out of the student's checkpoint (a real run's). A teacher that cannot teach the run is
refused in one line before any data is decoded; a real run with a shipped teacher trains and tests."""

import math
from pathlib import Path

import pytest
import torch
import yaml

import zoo
from zoo.train.distill import distillation_loss, load_teacher
from zoo.train.step import train_loss

REPO = Path(__file__).resolve().parents[2]


def log_softmax_by_hand(row: list[float]) -> list[float]:
    top = max(row)
    total = math.log(sum(math.exp(v - top) for v in row)) + top
    return [v - total for v in row]


def test_hard_term_is_cross_entropy_on_the_teachers_top_class():
    student, teacher = torch.randn(4, 5), torch.randn(4, 5)
    expected = -sum(log_softmax_by_hand(s.tolist())[int(t.argmax())] for s, t in zip(student, teacher, strict=True)) / 4
    assert distillation_loss(student, teacher, "hard", 1.0).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_soft_term_is_deits_kl(temperature):
    student, teacher = torch.randn(3, 4), torch.randn(3, 4)
    kl = 0.0
    for s, t in zip(student.tolist(), teacher.tolist(), strict=True):
        ls = log_softmax_by_hand([v / temperature for v in s])
        lt = log_softmax_by_hand([v / temperature for v in t])
        kl += sum(math.exp(b) * (b - a) for a, b in zip(ls, lt, strict=True))
    expected = kl * temperature**2 / student.numel()
    assert distillation_loss(student, teacher, "soft", temperature).item() == pytest.approx(expected, rel=1e-5)


def test_training_loss_mixes_the_terms_and_its_gradient_is_the_hand_mix():
    student = zoo.create_model("vit_nano", depth=1, embed_dim=32, num_heads=2)
    teacher = zoo.create_model("vit_nano", depth=1, embed_dim=32, num_heads=2).eval().requires_grad_(False)
    images, targets = torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))
    with torch.no_grad():
        taught = teacher(images)
    loss, logits = train_loss(student, images, targets, 0.1, torch.contiguous_format, taught, ("hard", 0.3, 1.0))
    own = torch.nn.functional.cross_entropy(logits, targets, label_smoothing=0.1)
    by_hand = 0.7 * own + 0.3 * torch.nn.functional.cross_entropy(logits, taught.argmax(dim=1))
    torch.testing.assert_close(loss, by_hand)
    weight = student.head.weight
    (grad,) = torch.autograd.grad(loss, weight, retain_graph=True)
    (expected,) = torch.autograd.grad(by_hand, weight)
    torch.testing.assert_close(grad, expected)
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize("spec, classes, size, match", [
    ("pretrained:hybrid_tiny", 5, 32, "predicts 10 classes; the data have 5"),
    ("pretrained:hybrid_tiny", 10, 64, r"takes \(32, 32\) images; this run trains at 64x64"),
    ("pretrained:nope", 10, 32, "no model named 'nope'"),
])
def test_a_teacher_that_cannot_teach_is_refused(spec, classes, size, match):
    with pytest.raises(ValueError, match=match):
        load_teacher(spec, classes, size)


def test_shipped_teacher_is_frozen():
    teacher = load_teacher("pretrained:hybrid_tiny", 10, 32)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())


def test_bad_teacher_is_one_line_before_any_data(tmp_path, run_train):
    done = run_train(["--model", "vit_nano", "--teacher", "pretrained:hybrid_tiny", "--distill-weight", "1.5",
                      "--data-dir", str(tmp_path / "none"), "--out", str(tmp_path)], cwd=REPO)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "train.py: error: distill_weight must lie in [0, 1], got 1.5"]


def test_a_real_run_learns_from_a_shipped_teacher(cifar_dir, tmp_path, run_train):
    cmd = ["--model", "vit_nano", "--set", "model_args.depth=1", "--data-dir",
           str(cifar_dir), "--epochs", "1", "--max-train-images", "128", "--max-test-images", "32",
           "--limit-train-batches", "2", "--limit-val-batches", "1", "--batch-size", "32", "--set", "val_size=32",
           "--teacher", "pretrained:hybrid_tiny", "--distill", "soft", "--distill-temperature", "2",
           "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache"), "--precision", "32"]
    done = run_train(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = (tmp_path / "vit_nano").iterdir()
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    student = zoo.create_model("vit_nano", depth=1).state_dict()
    assert {key.removeprefix("model.") for key in ckpt["state_dict"]} == set(student)  # the student alone
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert (config["teacher"], config["distill"], config["distill_temperature"]) == ("pretrained:hybrid_tiny", "soft",
                                                                                      2.0)
    assert (run / "summary.json").is_file()
