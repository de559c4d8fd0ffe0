"""pyproject.toml's promises: dependencies with lower bounds only (a newer torch than CI's pinned one is accepted,
so pip never downgrades it), each bound with its reason beside it and met by the installed environment, the test
dependencies in the dev extra, an Apache-2.0 LICENSE with its classifier, and one version (``zoo.__version__``)."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import zoo

REPO = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")   # Python 3.11+
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize("line", PROJECT["dependencies"])
def test_dependencies_have_a_lower_bound_and_no_cap(line):
    requirement = Requirement(line)
    assert [spec.operator for spec in requirement.specifier] == [">="], line
    assert requirement.specifier.contains("99.0"), line        # e.g. a torch far newer than CI's pinned one
    assert requirement.specifier.contains(version(requirement.name)), line   # the tested environment meets it


def test_every_dependency_bound_says_why():
    block = re.search(r"^dependencies = \[\n(.*?)^\]", (REPO / "pyproject.toml").read_text(), re.S | re.M).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == len(PROJECT["dependencies"]) and all("#" in line for line in lines)


def test_the_dev_extra_holds_the_test_dependencies():
    dev = {Requirement(line).name for line in PROJECT["optional-dependencies"]["dev"]}
    assert {"pytest", "hypothesis", "ruff", "grad-cam", "tensorboard"} <= dev


def test_license_and_single_version():
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert "License :: OSI Approved :: Apache Software License" in PROJECT["classifiers"]
    assert "version" not in PROJECT and PROJECT["dynamic"] == ["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", zoo.__version__)
