"""Publishing a run as shipped weights (zoo.train.publish) on a tiny real run: the card's accuracy agrees with
Lightning's test loop on the same images, the weights load back through timm's pretrained machinery with the
run's predictions, and eval.py --pretrained refuses what is not shipped."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import load_file

from zoo.models import load_run
from zoo.train.publish import main as publish_main
from zoo.train.publish import publish_run


def test_publish_writes_weights_and_a_card_that_agree_with_the_run(tiny_run, cifar_dir, tmp_path):
    card = publish_run(tiny_run, data_dir=cifar_dir, command="python train.py --model vit_nano ...",
                       out_dir=tmp_path, cache_dir=tmp_path / "cache", max_test_images=32)
    summary = json.loads((tiny_run / "summary.json").read_text())
    on_disk = json.loads((tmp_path / "vit_nano.json").read_text())
    assert on_disk == card
    # the same checkpoint on the same 32 seeded test images as Lightning's test loop (the recipe has no TTA)
    assert card["test_images"] == 32 and card["test_top1"] == pytest.approx(summary["test_top1"])
    assert card["mean"] == pytest.approx(summary["mean"]) and card["params"] == summary["params"]
    assert card["class_names"] == summary["class_names"] and 0 <= card["test_top1_tta"] <= 1
    model, _ = load_run(tiny_run)
    weights = load_file(str(tmp_path / "vit_nano.safetensors"))
    assert weights.keys() == model.state_dict().keys()
    loaded = timm.create_model("zoo_vit_nano", pretrained=True,
                               pretrained_cfg_overlay={"file": str(tmp_path / "vit_nano.safetensors")}).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_publish_of_a_missing_run_is_one_line(tmp_path, capsys):
    assert publish_main([str(tmp_path / "nope"), "--command", "x", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("publish: error:") and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.safetensors"))
