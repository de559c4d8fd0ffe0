"""pyproject.toml's promises: dependencies with lower bounds only (a newer torch than CI's pinned one is accepted,
so pip never downgrades it: checked on the specifiers, and in a slow test by pip itself in a fresh virtual
environment holding a stub torch 99.0, offline, with CI's pinned release on offer), each bound with its reason beside
it and met by the installed environment, the test dependencies in the dev extra, an Apache-2.0 LICENSE with its
classifier, and one version (``zoo.__version__``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
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
    assert {"pytest", "pytest-xdist", "hypothesis", "ruff", "grad-cam", "tensorboard", "captum", "lxt"} <= dev
    explain = {Requirement(line).name for line in PROJECT["optional-dependencies"]["explain"]}
    assert explain == {"captum"}


def test_license_and_single_version():
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert "License :: OSI Approved :: Apache Software License" in PROJECT["classifiers"]
    assert "version" not in PROJECT and PROJECT["dynamic"] == ["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", zoo.__version__)


def stub_wheel(folder: Path, name: str, version: str) -> None:
    """An empty wheel of ``name`` ``version`` (metadata only, no requirements) in ``folder``."""
    dist = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n")
        whl.writestr(f"{dist}.dist-info/RECORD", "")


def test_the_package_data_patterns_hold_every_recipe_and_shipped_weight():
    """The wheel carries zoo/configs/*.yaml and the shipped weights' Hub folders (what zoo-train and
    pretrained=True read from an installed package): every such file matches one of setuptools' package-data
    patterns (globs relative to the package). The wheel built and installed: tests/cli/test_install.py (slow)."""
    from fnmatch import fnmatch

    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["zoo"]
    package = REPO / "zoo"
    needed = [p for folder in ("configs", "weights") for p in (package / folder).rglob("*")
              if p.is_file() and "__pycache__" not in p.parts]
    assert any(p.suffix == ".yaml" for p in needed) and any(p.name == "model.safetensors" for p in needed)
    missing = [str(p.relative_to(package)) for p in needed
               if not any(fnmatch(str(p.relative_to(package)), pattern) for pattern in patterns)]
    assert not missing, f"not in the wheel: {missing}"


@pytest.mark.slow
def test_pip_keeps_a_newer_torch_already_installed(tmp_path):
    stubs, src, venv = tmp_path / "stubs", tmp_path / "src", tmp_path / "venv"
    stubs.mkdir()
    for line in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"]:
        requirement = Requirement(line)  # a newer version where the bound allows one (lxt==2.1 does not)
        versions = ["99.0", *(spec.version for spec in requirement.specifier), "0.1"]
        stub_wheel(stubs, requirement.name, next(v for v in versions if requirement.specifier.contains(v)))
    stub_wheel(stubs, "torch", "2.14.1")   # what CI pins, on offer beside the newer one
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "zoo", src / "zoo", ignore=shutil.ignore_patterns("__pycache__", "weights"))
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # zoo's wheel is built here (the fresh environment's setuptools may lack bdist_wheel): pip resolves its
    # dependencies exactly as for ``pip install -e ".[dev]"``
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                    stubs, src], check=True, env=env, capture_output=True, timeout=300, cwd=tmp_path)
    (wheel,) = stubs.glob("zoo-*.whl")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=300)   # its own pip
    pip = [venv / "bin" / "python", "-m", "pip", "--no-input", "install", "--no-index", "--find-links", stubs]
    subprocess.run([*pip, "torch==99.0"], check=True, env=env, capture_output=True, timeout=300)
    done = subprocess.run([*pip, "--dry-run", "--report", tmp_path / "report.json", f"zoo[dev] @ {wheel.as_uri()}"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = {item["metadata"]["name"]: item["metadata"]["version"]
              for item in json.loads((tmp_path / "report.json").read_text())["install"]}
    assert "zoo" in chosen and "torch" not in chosen, chosen   # the installed torch 99.0 satisfies zoo
