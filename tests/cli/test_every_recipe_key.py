"""Every recipe key (each field of the Recipe and of its augment section, found by iterating the dataclasses, not
a hand-picked list) given a value of the wrong type exits 2 with one line before any data is decoded; a negative
number for a numeric key is either refused the same way or accepted, never a traceback. Through the command line
(``train.py --set key=value``), so the test holds whatever parses the settings. So does every extreme value
(0, negative, 1e308, inf, NaN, 10**30, text), through ``--set`` and through a config file; the largest values
that are accepted train (one short run)."""

from __future__ import annotations

import dataclasses

import pytest

from zoo.data import ImageData
from zoo.train import cli
from zoo.train.checks import FLOAT32_MAX, INT64_MAX, MAX_MINUTES
from zoo.train.recipe import AugmentConfig, Recipe

SKIP = {"model"}  # given by --model
KEYS = [f.name for f in dataclasses.fields(Recipe) if f.name not in SKIP] + [
    f"augment.{f.name}" for f in dataclasses.fields(AugmentConfig)]

def numeric(f: dataclasses.Field) -> bool:
    """A field typed int or float (optionally None): the annotation, as the defaults are factories."""
    return str(f.type).split(" | ")[0] in ("int", "float")


NUMERIC = [f.name for f in dataclasses.fields(Recipe) if numeric(f)] + [
    f"augment.{f.name}" for f in dataclasses.fields(AugmentConfig) if numeric(f)]
assert len(NUMERIC) > 10, NUMERIC  # the parametrisation below must not come out empty


class DataReached(Exception):
    """The run got as far as reading the data: the setting was accepted."""


@pytest.fixture
def train(monkeypatch, tmp_path, capsys):
    def reached(self, *args, **kwargs):
        raise DataReached

    monkeypatch.setattr(ImageData, "prepare_data", reached)
    monkeypatch.setattr(ImageData, "setup", reached)

    def run(key: str, value: str, route: str = "--set") -> tuple[int | None, list[str]]:
        # flags outrank --set: the folders go in as --set values too, which the key under test then overrides
        argv = ["--model", "vit_nano", "--set", f"out={tmp_path / 'runs'}", "--set", f"data_dir={tmp_path / 'data'}"]
        if route == "--set":
            argv += ["--set", f"{key}={value}"]
        else:  # the same text as a config file's line, nested under its section
            *section, leaf = key.split(".")
            lines = [f"{section[0]}:", f"  {leaf}: {value}"] if section else [f"{leaf}: {value}"]
            (tmp_path / "extreme.yaml").write_text("\n".join(lines) + "\n")
            argv = ["--config", str(tmp_path / "extreme.yaml"), *argv]
        try:
            code = cli.main(argv)
        except DataReached:
            code = None
        except SystemExit as exit:
            code = exit.code
        return code, capsys.readouterr().err.strip().splitlines()

    return run


@pytest.mark.parametrize("value", ["{a: 1}", "[1, 2]"], ids=["mapping", "list"])
@pytest.mark.parametrize("key", KEYS)
def test_a_wrong_type_exits_2_in_one_line_before_the_data(train, key, value):
    code, err = train(key, value)
    assert code == 2, f"--set {key}={value} was accepted"
    lines = [line for line in err if "error" in line]
    assert len(lines) == 1 and "Traceback" not in "\n".join(err), err


@pytest.mark.parametrize("key", NUMERIC)
def test_a_negative_number_is_refused_in_one_line_or_accepted(train, key):
    code, err = train(key, "-1")
    assert code in (2, None), err
    assert "Traceback" not in "\n".join(err)
    if code == 2:
        assert len([line for line in err if "error" in line]) == 1, err


EXTREMES = {"zero": "0", "negative": "-1", "1e308": "1e308", "inf": ".inf", "-inf": "-.inf", "nan": ".nan",
            "10**30": str(10**30), "10**400": str(10**400), "text": "many", "true": "true"}
MODEL_ARGS = ["model_args.depth", "model_args.embed_dim", "model_args.num_heads", "model_args.drop_path_rate",
              "model_args.drop_rate", "model_args.mlp_ratio", "model_args.patch_size", "model_args.reg_tokens"]


@pytest.mark.parametrize("route", ["--set", "config"])
@pytest.mark.parametrize("key", KEYS + MODEL_ARGS)
def test_extreme_values_are_refused_in_one_line_before_the_data_or_accepted(train, key, route):
    """Each extreme value either ends the command with one line and exit 2 before the data are read, or is
    accepted (it reaches the data); a traceback, or a value accepted here that fails later, is a bug (the six that
    did: ckpt_every_minutes=1e13, no_decay_lr_scale=1e308, augment.crop_padding=100000, img_size=100000,
    --devices 0,1 on a CPU and model_args.drop_path_rate=2.0 are among these and are refused now)."""
    for what, value in EXTREMES.items():
        code, err = train(key, value, route)
        assert code in (2, None), (what, err)
        assert "Traceback" not in "\n".join(err), (what, err)
        if code == 2:
            assert len([line for line in err if "error" in line]) == 1, (what, err)


@pytest.mark.parametrize("key, value, match", [
    ("ckpt_every_minutes", "1e13", r"ckpt_every_minutes must be at most 1,439,999,999,999 minutes"),
    ("no_decay_lr_scale", "1e308", r"no_decay_lr_scale must be at most 3.403e\+38 \(float32's largest number\)"),
    ("augment.crop_padding", "100000", r"augment.crop_padding must be at most img_size \(32\), got 100000"),
    ("img_size", "100000", r"a batch of .* images of img_size 100000 takes .* GiB in float32, more than this machine"),
    ("devices", "0,1", r"--devices 0,1 lists GPU indices, but the run is on the CPU"),
    ("model_args.drop_path_rate", "2.0", r"model_args.drop_path_rate must be a probability in \[0, 1\), got 2.0"),
    ("model_args.depth", str(10**9), r"model_args.depth must be an int in \[1, 1,000\], got 1000000000"),
    ("model_args.embed_dim", str(10**6), r"vit_nano with .* would hold over .* parameter elements .* more than this"),
    ("seed", str(10**30), r"seed must be at most 2\*\*63 - 1"),
    ("seed", str(2**32), r"seed must be at most 2\*\*32 - 1 \(4294967295, the largest seed numpy and Lightning take\)"),
])
def test_values_that_failed_after_the_decode_are_refused_first(train, key, value, match):
    if key == "devices":
        pytest.importorskip("torch").cuda.is_available() and pytest.skip("the CPU's refusal")
    code, err = train(key, value)
    assert code == 2 and len(err) == 1 and __import__("re").search(match, err[0]), err


def test_a_product_beyond_float32_is_refused():
    with pytest.raises(ValueError, match=r"lr \* no_decay_lr_scale must be at most 3.403e\+38 .*got 1000.0 \* 1e\+36"):
        Recipe(model="vit_nano", lr=1e3, no_decay_lr_scale=1e36)


def test_the_largest_accepted_values_train(cifar_dir, tmp_path, run_train):
    """Settings at the top of their ranges (or 10**30 where that is beyond any sense but within float32) train: two
    steps on 64 real images, exit 0."""
    edge = {"ckpt_every_minutes": MAX_MINUTES, "ckpt_every_n_steps": INT64_MAX, "seed": 2**32 - 1,
            "no_decay_lr_scale": 1e30, "weight_decay": 1e30, "momentum": 1e30, "warmup_epochs": 1e30,
            "min_lr_ratio": 1e30, "augment.mixup_alpha": 1e30, "augment.cutmix_alpha": 1e30,
            "augment.crop_padding": 32, "augment.cutout": 32,
            "model_args.drop_path_rate": 0.99, "data_memory_budget": FLOAT32_MAX, "max_test_images": 16}
    cmd = ["--model", "vit_nano", "--data-dir", str(cifar_dir), "--epochs", "1",
           "--max-train-images", "64", "--limit-train-batches", "2", "--limit-val-batches", "1",
           "--limit-test-batches", "1", "--batch-size", "32", "--out", str(tmp_path / "runs"),
           "--cache-dir", str(tmp_path / "cache"), "--set", "val_size=16", "--precision", "32"]
    for key, value in edge.items():
        cmd += ["--set", f"{key}={value}"]
    done = run_train(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
