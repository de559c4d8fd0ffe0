"""train.py's flags come from the recipe's fields: every recipe key is a flag with its doc line in --help, a flag
sets the same value as ``--set`` of that key, flags win over --set and --config whatever their order, and
``--print-config`` prints the resolved recipe, which loads back to an equal one. A run's checkpoint loads into the
LightningModule with the recipe's values as its hyper-parameters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import train  # noqa: E402
from zoo.train.recipe import AugmentConfig, Recipe, resolve_config  # noqa: E402


def printed(args: list[str], capsys) -> dict:
    assert train.main([*args, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_every_recipe_key_is_a_flag_with_its_doc_line(capsys):
    from dataclasses import fields

    from zoo.train.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    keys = [f.name for f in fields(Recipe) if f.name not in ("augment", "loggers")]
    keys += [f"augment.{f.name}" for f in fields(AugmentConfig)]
    for key in keys:
        assert f"--{key.replace('_', '-')} " in text, key
    assert "--logger " in text and "--print-config" in text
    assert " ".join(Recipe.__dataclass_fields__["muon_dtype"].metadata["doc"].split()) in text


@pytest.mark.parametrize("flag, value, key", [
    ("--augment.mixup-alpha", "0.3", "augment.mixup_alpha"), ("--weight-decay", "1e-4", "weight_decay"),
    ("--model-args", "{depth: 2}", "model_args"), ("--devices", "0,1", "devices"), ("--tta", "1", "tta"),
    ("--compile", "regions", "compile"), ("--limit-train-batches", "0.5", "limit_train_batches"),
    ("--augment.randaugment", "{num_ops: 1}", "augment.randaugment"), ("--no-fit-whitening", None, "fit_whitening"),
])
def test_a_flag_sets_what_set_of_its_key_sets(flag, value, key, capsys):
    by_flag = printed(["--model", "vit_nano", flag, *([value] if value is not None else [])], capsys)
    by_set = resolve_config("vit_nano", None, [f"{key}={value if value is not None else 'false'}"]).to_dict()
    assert by_flag == by_set
    assert by_flag != resolve_config("vit_nano").to_dict()   # the value is not the recipe's own


def test_flags_win_over_set_and_config_in_any_order(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("lr: 0.1\nepochs: 3\naugment: {cutout: 4}\n")
    seen = printed(["--epochs", "5", "--set", "epochs=4", "--config", str(config), "--model", "vit_nano",
                    "--set", "lr=0.2", "--augment.cutout", "8"], capsys)
    assert (seen["epochs"], seen["lr"], seen["augment"]["cutout"]) == (5, 0.2, 8)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(seen, sort_keys=False))
    assert Recipe.from_yaml(path).to_dict() == seen


def test_a_runs_checkpoint_loads_into_the_lightning_module_with_the_recipes_values(tmp_path, image_tree_writer,
                                                                                     run_train):
    from zoo.train import ImageClassifier

    tree = image_tree_writer(tmp_path / "tree", 16, counts=(("train", 2), ("test", 1)), classes=3)
    done = run_train(["--model", "vit_nano", "--data-dir", tree, "--img-size", "16", "--lr", "0.0123",
                      "--weight-decay", "0.01", "--momentum", "0.8", "--optimizer", "sgd", "--tta", "1",
                      "--label-smoothing", "0.2", "--set", "no_decay_lr_scale=2.0", "--set", "model_args.depth=1",
                      "--muon-dtype", "float32", "--epochs", "1", "--batch-size", "2", "--set", "val_size=2",
                      "--precision", "32", "--out", tmp_path / "runs", "--cache-dir", tmp_path / "cache"])
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = (tmp_path / "runs" / "vit_nano").iterdir()
    module = ImageClassifier.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu")
    expected = {"model_name": "vit_nano", "model_args": {"drop_path_rate": 0.05, "depth": 1, "img_size": 16},
                "num_classes": 3, "lr": 0.0123,
                "weight_decay": 0.01, "momentum": 0.8, "optimizer": "sgd", "tta": 1, "label_smoothing": 0.2,
                "no_decay_lr_scale": 2.0, "muon_dtype": "float32", "channels_last": False}
    assert {key: module.hparams[key] for key in expected} == expected
    weights = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    for key, value in module.state_dict().items():
        if key.startswith("model."):
            torch.testing.assert_close(value, weights[key], rtol=0, atol=0)
