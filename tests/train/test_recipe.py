"""Recipe resolution: precedence (model yaml < --config < --set < flags), unknown keys, value parsing."""

from __future__ import annotations

import pytest
import yaml

import zoo
from zoo.train.recipe import CONFIG_DIR, parse_limit, parse_max_time, parse_set, resolve_config


def test_every_registered_model_has_a_recipe_that_builds():
    for name in zoo.list_models():
        path = CONFIG_DIR / f"{name}.yaml"
        assert path.is_file(), f"missing recipe {path}"
        cfg = resolve_config(name)
        raw = yaml.safe_load(path.read_text())
        assert cfg["epochs"] == raw["epochs"] and cfg["lr"] == raw["lr"]
        model = zoo.create_model(name, num_classes=10, img_size=cfg["img_size"], **cfg["model_args"])
        assert sum(p.numel() for p in model.parameters()) > 0


def test_precedence_yaml_then_file_then_set_then_flags(tmp_path):
    raw = yaml.safe_load((CONFIG_DIR / "vit_tiny.yaml").read_text())
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lr: 0.1\nepochs: 3\nbatch_size: 32\naugment: {hflip: false}\n")
    cfg = resolve_config("vit_tiny", recipe, ["lr=0.2", "augment.mixup_alpha=0.5", "model_args.depth=4"],
                         {"epochs": 7, "lr": None})
    assert cfg["weight_decay"] == raw["weight_decay"]          # only in the model's yaml
    assert cfg["batch_size"] == 32                              # --config over the yaml
    assert cfg["lr"] == 0.2                                     # --set over --config; flag None = not given
    assert cfg["epochs"] == 7                                   # flag over everything
    assert cfg["augment"]["hflip"] is False and cfg["augment"]["mixup_alpha"] == 0.5
    assert cfg["augment"]["crop_padding"] == raw["augment"]["crop_padding"]   # nested keys merge
    assert cfg["model_args"] == {**raw["model_args"], "depth": 4}


@pytest.mark.parametrize("layer", ["file", "set", "nested"])
def test_unknown_key_names_the_valid_ones(tmp_path, layer):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 0.1\n" if layer == "file" else "{}\n")
    overrides = {"file": [], "set": ["epoch=3"], "nested": ["augment.mixpu_alpha=0.2"]}[layer]
    with pytest.raises(ValueError, match="unknown config key") as err:
        resolve_config("vit_tiny", recipe, overrides)
    assert ("augment.mixup_alpha" if layer == "nested" else "epochs") in str(err.value)


def test_config_file_chooses_the_model_and_unknown_models_suggest():
    cfg = resolve_config(None, CONFIG_DIR / "test_tiny.yaml")
    assert cfg["model"] == "hybrid_tiny" and cfg["model_args"]["depth"] == 1
    with pytest.raises(ValueError, match="vit_tiny"):
        resolve_config("vit_tiy")
    with pytest.raises(ValueError, match="--model"):
        resolve_config(None)


@pytest.mark.parametrize("bad, message", [({"precision": "fp8"}, "precision must be one of"),
                                          ({"epochs": 0}, "epochs must be a positive"),
                                          ({"max_time": "10 minutes"}, "DD:HH:MM:SS"),
                                          ({"limit_train_batches": "a few"}, "batch limit")])
def test_bad_values_raise(bad, message):
    with pytest.raises(ValueError, match=message):
        resolve_config("vit_tiny", flags=bad)


def test_value_parsing():
    expected = {"a": {"b": 1, "c": [1, 2]}, "d": None, "e": 3e-4, "f": "bf16-mixed"}
    assert parse_set(["a.b=1", "a.c=[1, 2]", "d=null", "e=3e-4", "f=bf16-mixed"]) == expected
    assert parse_set(["lr=0.0003"]) == {"lr": 0.0003}
    assert parse_max_time("01:02:03:04") == ((1 * 24 + 2) * 60 + 3) * 60 + 4
    assert parse_limit("2") == 2 and isinstance(parse_limit("2"), int)
    assert parse_limit("1.0") == 1.0 and isinstance(parse_limit("1.0"), float)
    assert parse_limit("0.25") == 0.25
    with pytest.raises(ValueError, match="key=value"):
        parse_set(["lr"])
