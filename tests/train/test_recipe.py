"""The typed recipe: every registered model has one, precedence (model yaml < --config < --set < flags), unknown
keys, wrong types, value parsing, config.yaml round trip."""

from __future__ import annotations

import re
from dataclasses import asdict, fields
from pathlib import Path

import pytest
import yaml

import zoo
from zoo.data import DEFAULT_AUGMENT
from zoo.train import recipe as recipe_module
from zoo.train.checks import parse_limit, parse_max_time
from zoo.train.recipe import CONFIG_DIR, AugmentConfig, Recipe, parse_set, resolve_config


@pytest.mark.parametrize("name", zoo.list_models())
def test_every_registered_model_has_a_recipe_that_builds(name):
    path = CONFIG_DIR / f"{name}.yaml"
    assert path.is_file(), f"missing recipe {path}"
    cfg = resolve_config(name)
    raw = yaml.safe_load(path.read_text())
    assert cfg.epochs == raw["epochs"] and cfg.lr == raw["lr"]
    assert cfg.model_args == raw["model_args"] and asdict(cfg.augment) == raw["augment"]
    model = zoo.create_model(name, num_classes=10, img_size=cfg.img_size, **cfg.model_args)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_recipes_live_inside_the_package():
    assert CONFIG_DIR == Path(zoo.__file__).resolve().parent / "configs"


def test_a_missing_recipe_is_an_error_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(recipe_module, "CONFIG_DIR", tmp_path)
    with pytest.raises(ValueError, match="no recipe for model 'vit_tiny'") as err:
        resolve_config("vit_tiny")
    assert str(tmp_path / "vit_tiny.yaml") in str(err.value)


def test_precedence_yaml_then_file_then_set_then_flags(tmp_path):
    raw = yaml.safe_load((CONFIG_DIR / "vit_tiny.yaml").read_text())
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lr: 0.1\nepochs: 3\nbatch_size: 32\naugment: {hflip: false}\n")
    cfg = resolve_config("vit_tiny", recipe, ["lr=0.2", "augment.mixup_alpha=0.5", "model_args.depth=4"],
                         {"epochs": 7, "lr": None})
    assert cfg.weight_decay == raw["weight_decay"]             # only in the model's yaml
    assert cfg.batch_size == 32                                 # --config over the yaml
    assert cfg.lr == 0.2                                        # --set over --config; flag None = not given
    assert cfg.epochs == 7                                      # flag over everything
    assert cfg.augment.hflip is False and cfg.augment.mixup_alpha == 0.5
    assert cfg.augment.crop_padding == raw["augment"]["crop_padding"]   # nested keys merge
    assert cfg.augment.randaugment == raw["augment"]["randaugment"]
    assert cfg.model_args == {**raw["model_args"], "depth": 4}
    assert cfg.warmup_epochs == raw["warmup_epochs"] and cfg.val_size == Recipe().val_size   # defaults fill in


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
    assert cfg.model == "hybrid_tiny" and cfg.model_args["depth"] == 1
    with pytest.raises(ValueError, match="vit_tiny"):
        resolve_config("vit_tiy")
    with pytest.raises(ValueError, match="--model"):
        resolve_config(None)


@pytest.mark.parametrize("bad, message", [({"precision": "fp8"}, "precision must be one of"),
                                          ({"epochs": 0}, "epochs must be a positive"),
                                          ({"max_time": "10 minutes"}, "DD:HH:MM:SS"),
                                          ({"limit_train_batches": "a few"}, "batch limit"),
                                          ({"devices": [1]}, "devices must be auto"),
                                          ({"channels_last": "yes"}, "channels_last must be auto, true or false"),
                                          ({"compile": "maybe"},
                                           "compile must be regions, step, true or false, got 'maybe'"),
                                          ({"seed": 1.5}, "seed must be a non-negative integer, got 1.5")])
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


def test_a_budget_of_a_day_or_more_reads_as_written_in_set_and_in_a_config_file(tmp_path):
    """YAML 1.1 reads ``1:00:00:00`` as the base-60 integer 216000 (``yaml.safe_load`` does); a budget is text."""
    assert yaml.safe_load("max_time: 1:00:00:00") == {"max_time": 216000}  # what the loader must not do
    config = tmp_path / "day.yaml"
    config.write_text("max_time: 10:00:00:00\nlr: 1:30.5e0\n")
    assert resolve_config("vit_tiny", overrides=["max_time=1:00:00:00"]).max_time == "1:00:00:00"
    assert parse_max_time(resolve_config("vit_tiny", overrides=["max_time=1:00:00:00"]).max_time) == 24 * 3600
    with pytest.raises(ValueError, match=re.escape("lr must be a non-negative number, got '1:30.5e0'")):
        resolve_config("vit_tiny", config)
    assert parse_set(["a=1_000", "b=0x1F", "c=-2.5", "d=.inf"]) == {"a": 1000, "b": 31, "c": -2.5, "d": float("inf")}
    config.write_text("max_time: 10:00:00:00\n")
    assert resolve_config("vit_tiny", config).max_time == "10:00:00:00"


def test_a_path_under_home_written_with_a_tilde_is_the_home_folder(tmp_path, monkeypatch):
    """A shell expands ``~`` in a flag, never in a config file or a --set value: the recipe does it there."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "paths.yaml"
    config.write_text("data_dir: ~/cifar\nout: ~/runs\ncache_dir: ~/cache\ninit_from: ~/w.pt\n")
    recipe = resolve_config("vit_tiny", config, ["resume=~/runs/vit_tiny/a"])
    paths = (recipe.data_dir, recipe.out, recipe.cache_dir, recipe.init_from, recipe.resume)
    assert paths == tuple(str(tmp_path / p) for p in ("cifar", "runs", "cache", "w.pt", "runs/vit_tiny/a"))
    assert resolve_config("vit_tiny", overrides=["resume=auto", "out=runs"]).resume == "auto"
    assert resolve_config("vit_tiny", overrides=["out=runs"]).out == "runs"  # a relative path stays relative


def test_a_shipped_recipe_is_found_by_name_from_any_folder(tmp_path, monkeypatch):
    """README's ``--config configs/cpu_budget.yaml`` also works from an installed wheel, away from the checkout."""
    monkeypatch.chdir(tmp_path)
    shipped = resolve_config("hybrid_tiny", CONFIG_DIR / "cpu_budget.yaml")
    assert shipped != resolve_config("hybrid_tiny")
    for given in ("configs/cpu_budget.yaml", "cpu_budget", "cpu_budget.yaml"):
        assert resolve_config("hybrid_tiny", given) == shipped, given
    (tmp_path / "cpu_budget.yaml").write_text("epochs: 3\n")  # a file that is there is the one read
    assert resolve_config("hybrid_tiny", "cpu_budget.yaml").epochs == 3
    with pytest.raises(ValueError, match=r"cannot read config file configs/nope.yaml: No such file"):
        resolve_config("hybrid_tiny", "configs/nope.yaml")


def test_a_config_key_that_is_not_text_is_an_unknown_key(tmp_path):
    config = tmp_path / "keys.yaml"
    config.write_text("augment: {1: 2}\n")
    with pytest.raises(ValueError, match=re.escape(f"unknown config key augment.1 in {config}; valid keys: ")):
        resolve_config("vit_tiny", config)
    assert resolve_config("vit_tiny", overrides=["limit_train_batches=2.0"]).limit_train_batches == 2.0


@pytest.mark.parametrize("overrides, message", [
    (["lr=fast"], "lr must be a non-negative number, got 'fast'"),
    (["val_size=-1"], "val_size must be a non-negative integer, got -1"),
    (["batch_size=0.5"], "batch_size must be a positive integer, got 0.5"),
    (["augment.mixup_alpha=-0.2"], "augment.mixup_alpha must be a non-negative number, got -0.2"),
    (["augment.hflip=3"], "augment.hflip must be true or false, got 3"),
    (["augment.randaugment=[2, 9]"], "augment.randaugment must be null, true, false or a mapping"),
    (["augment=3"], "config key 'augment' in --set must be a mapping, got 3"),
    (["model_args=[1]"], "config key 'model_args' in --set must be a mapping"),
    # what Lightning or the model would refuse only after the data were decoded (or ignore)
    (["model_args.num_classes=10"], "model_args.num_classes is not a recipe setting: the data's classes set it"),
    (["model_args.img_size=64"], "model_args.img_size is not a recipe setting: give img_size"),
    (["max_time=0:0:10:0"], "--max-time expects DD:HH:MM:SS (e.g. 00:00:10:00), got '0:0:10:0'"),
    (["limit_train_batches=2.5"], "limit_train_batches must be a batch limit: an integer (batches) or a fraction"),
])
def test_wrong_types_name_the_key_expected_and_given(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_config("vit_tiny", overrides=overrides)


def test_set_reaches_top_level_and_nested_keys():
    cfg = resolve_config("vit_nano", overrides=["val_size=128", "augment.mixup_alpha=0.2", "model_args.depth=2",
                                                "lr=3e-4", "devices=2", "limit_val_batches=0.5"])
    assert cfg.val_size == 128 and cfg.augment.mixup_alpha == 0.2 and cfg.model_args["depth"] == 2
    assert cfg.lr == 3e-4 and cfg.devices == 2 and cfg.limit_val_batches == 0.5


def test_config_yaml_round_trip(tmp_path):
    cfg = resolve_config(None, CONFIG_DIR / "test_tiny.yaml", ["augment.randaugment={num_ops: 1}", "devices=2"],
                         {"max_time": "00:00:01:00", "limit_train_batches": "3", "precision": "bf16-mixed"})
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert Recipe.from_yaml(path) == cfg
    assert Recipe.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
    assert resolve_config(None, path) == cfg                    # a run's config.yaml works as --config
    assert set(yaml.safe_load(path.read_text())) == {f.name for f in fields(Recipe)}
    for name in zoo.list_models():                              # the shipped recipes use the same keys
        raw = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
        assert set(raw) <= {f.name for f in fields(Recipe)}
        assert set(raw["augment"]) == {f.name for f in fields(AugmentConfig)}


def test_one_definition_of_the_defaults_with_a_doc_line_each():
    assert asdict(AugmentConfig()) == DEFAULT_AUGMENT
    assert Recipe().augment == AugmentConfig() and Recipe().model_args == {}
    assert Recipe().model_args is not Recipe().model_args     # no shared mutable default
    for cls in (Recipe, AugmentConfig):
        assert all(f.metadata["doc"] for f in fields(cls))


def test_direct_construction_is_validated_too():
    assert Recipe(model="vit_nano", augment={"hflip": False}).augment == AugmentConfig(hflip=False)
    with pytest.raises(ValueError, match="unknown config key augment.flip"):
        Recipe(augment={"flip": False})
    with pytest.raises(ValueError, match="epochs must be a positive integer, got '3'"):
        Recipe(epochs="3")
