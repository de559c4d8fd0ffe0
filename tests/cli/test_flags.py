"""train.py's flags come from the recipe's fields: every recipe key is a flag with its doc line in --help, a flag
sets the same value as ``--set`` of that key, flags win over --set and --config whatever their order, and
``--print-config`` prints the resolved recipe, which loads back to an equal one. fit.py hands the recipe's values to
the LightningModule by name: the module's hyper-parameters are the recipe's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
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
    assert " ".join(Recipe.__dataclass_fields__["optimizer_min_speed"].metadata["doc"].split()) in text


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


def test_the_module_gets_the_recipes_values_by_name(tmp_path):
    from zoo.train.fit import RunPlan, build_module

    recipe = Recipe.from_dict({"model": "vit_nano", "lr": 0.0123, "weight_decay": 0.01, "momentum": 0.8,
                               "optimizer": "sgd", "schedule": "linear", "tta": 1, "label_smoothing": 0.2,
                               "min_lr_ratio": 0.1, "no_decay_lr_scale": 2.0, "warmup_epochs": 2.0, "epochs": 8,
                               "model_args": {"depth": 1}, "img_size": 32, "muon_dtype": "float32"})

    class Data:  # what build_module reads of a data module
        num_classes = 3

    hp = build_module(RunPlan(recipe, "cpu", "32", tmp_path, None), Data()).hparams
    expected = {"model_name": "vit_nano", "model_args": {"depth": 1, "img_size": 32}, "num_classes": 3, "lr": 0.0123,
                "weight_decay": 0.01, "momentum": 0.8, "optimizer": "sgd", "schedule": "linear", "tta": 1,
                "label_smoothing": 0.2, "min_lr_ratio": 0.1, "no_decay_lr_scale": 2.0, "warmup_frac": 0.25,
                "muon_dtype": "float32", "channels_last": False, "compile": False}
    assert {key: hp[key] for key in expected} == expected
