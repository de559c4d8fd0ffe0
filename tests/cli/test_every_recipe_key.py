"""Every recipe key (each field of the Recipe and of its augment section, found by iterating the dataclasses, not
a hand-picked list) given a value of the wrong type exits 2 with one line before any data is decoded; a negative
number for a numeric key is either refused the same way or accepted, never a traceback. Through the command line
(``train.py --set key=value``), so the test holds whatever parses the settings."""

from __future__ import annotations

import dataclasses

import pytest

from zoo.train import cli
from zoo.train.data import ImageDataModule
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

    monkeypatch.setattr(ImageDataModule, "prepare_data", reached)
    monkeypatch.setattr(ImageDataModule, "setup", reached)

    def run(key: str, value: str) -> tuple[int | None, list[str]]:
        # flags outrank --set: the folders go in as --set values too, which the key under test then overrides
        argv = ["--model", "vit_nano", "--set", f"out={tmp_path / 'runs'}", "--set", f"data_dir={tmp_path / 'data'}",
                "--set", f"{key}={value}"]
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
