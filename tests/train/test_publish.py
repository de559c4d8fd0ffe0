"""Publishing a run (zoo.train.publish) on a tiny real run: the card's accuracy agrees with Lightning's test loop
on the same images, the folder is in the Hub's layout (config.json, model.safetensors, a README.md with front
matter) and ``timm.create_model("local-dir:...")`` loads it with the run's predictions and data config."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import load_file
from timm.data import resolve_model_data_config

from zoo.models import load_run
from zoo.train.publish import main as publish_main
from zoo.train.publish import publish_run


def test_publish_writes_a_hub_folder_that_timm_loads_with_the_runs_predictions(tiny_run, cifar_dir, tmp_path):
    out = tmp_path / "vit_nano"
    card = publish_run(tiny_run, out, data_dir=cifar_dir, command="python train.py --model vit_nano ...",
                       cache_dir=tmp_path / "cache", max_test_images=32)
    summary = json.loads((tiny_run / "summary.json").read_text())
    (cache,) = (tmp_path / "cache").rglob("*.pt")  # the run's normalisation is reused: no train image decoded
    assert len(torch.load(cache, weights_only=True)["train_images"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_card"] == card and config["architecture"] == "zoo_vit_nano"
    # the same checkpoint on the same 32 seeded test images as Lightning's test loop (the recipe has no TTA)
    assert card["test_images"] == 32 and card["test_top1"] == pytest.approx(summary["test_top1"])
    assert card["mean"] == pytest.approx(summary["mean"]) and card["params"] == summary["params"]
    assert card["class_names"] == summary["class_names"] and 0 <= card["test_top1_tta"] <= 1
    readme = (out / "README.md").read_text()
    front, body = readme.removeprefix("---\n").split("---\n", 1)
    assert {"library_name: timm", "license: apache-2.0", "pipeline_tag: image-classification"} <= set(
        front.splitlines()) and f"{card['test_top1']:.4f}" in body
    model, _ = load_run(tiny_run)
    weights = load_file(str(out / "model.safetensors"))
    assert weights.keys() == model.state_dict().keys()
    loaded = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    data = resolve_model_data_config(loaded)
    assert data["mean"] == pytest.approx(summary["mean"]) and data["std"] == pytest.approx(summary["std"])
    assert tuple(data["input_size"]) == (3, summary["img_size"], summary["img_size"])
    assert loaded.pretrained_cfg["label_names"] == summary["class_names"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_publish_of_a_missing_run_is_one_line(tmp_path, capsys):
    assert publish_main([str(tmp_path / "nope"), "--command", "x", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("publish: error:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_publish_onto_a_published_folder_is_refused_unless_force(tiny_run, cifar_dir, tmp_path, capsys):
    """A folder already holding a model card is left byte for byte as it was (one line naming --force, exit 2,
    before the test set is read); with force its files are replaced by the run's."""
    out = tmp_path / "published"
    out.mkdir()
    (out / "README.md").write_text("my model card\n")
    (out / "notes.txt").write_text("mine\n")
    assert publish_main([str(tiny_run), "--command", "x", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("publish: error:") and len(err.strip().splitlines()) == 1 and "--force" in err
    assert "README.md" in err and sorted(p.name for p in out.iterdir()) == ["README.md", "notes.txt"]
    assert (out / "README.md").read_text() == "my model card\n"
    with pytest.raises(ValueError, match="--force"):
        publish_run(tiny_run, out, data_dir=cifar_dir, cache_dir=tmp_path / "cache", max_test_images=32)
    card = publish_run(tiny_run, out, data_dir=cifar_dir, command="x", cache_dir=tmp_path / "cache",
                       max_test_images=32, force=True)
    assert (out / "README.md").read_text().startswith("---\n") and (out / "notes.txt").read_text() == "mine\n"
    assert json.loads((out / "config.json").read_text())["model_card"] == card
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors", "notes.txt"]
