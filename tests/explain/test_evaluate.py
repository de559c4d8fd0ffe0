"""``zoo.explain.report.evaluate`` (eval.py's test-set metrics) against counts taken by hand over the same batches,
with its host reads independent of the number of batches (on a GPU each read waits for the device)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import zoo
from zoo.bench.dispatch import OpRecorder
from zoo.data import ImageData
from zoo.explain.report import evaluate


def test_metrics_equal_a_hand_count_and_reads_do_not_grow_with_the_batches(tmp_path, image_tree_writer):
    tree = image_tree_writer(tmp_path / "tree", 16, counts=(("train", 2), ("test", 4)))
    torch.manual_seed(0)
    model = zoo.create_model("vit_nano", num_classes=10, embed_dim=32, depth=1, num_heads=2, img_size=16).eval()
    reads = {}
    for batch_size in (8, 20):  # 5 batches, then 2
        dm = ImageData(tree, img_size=16, batch_size=batch_size, val_size=2, cache_dir=tmp_path / "cache")
        dm.setup("test")
        with OpRecorder() as ops:
            metrics, matrix = evaluate(model, dm)
        reads[batch_size] = len(ops.syncs)
    images, labels = dm.test_dataset.images, dm.test_dataset.labels
    with torch.no_grad():
        logits = model(dm.normalize(images)).float()
    assert metrics["num_images"] == len(labels) == 40 and int(matrix.sum()) == 40
    assert metrics["test_top1"] == (logits.argmax(1) == labels).sum().item() / 40
    assert metrics["test_top5"] == (logits.topk(5, 1).indices == labels[:, None]).any(1).sum().item() / 40
    assert abs(metrics["test_cross_entropy"] - F.cross_entropy(logits, labels).item()) < 1e-5
    assert reads[8] == reads[20], reads
