"""The installed package, away from the checkout: a wheel built offline (``pip wheel --no-deps
--no-build-isolation``, from a copy of the sources so no build/ folder lands in the checkout), installed with
``pip install --no-deps --target DIR`` and run as ``DIR/bin/zoo-train`` from another working directory with
``PYTHONPATH=DIR`` (torch, Lightning etc. come from the test's own environment). The run must import zoo from
DIR and train with the model's recipe shipped inside the wheel (zoo/configs/<model>.yaml)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from zoo.train.recipe import Recipe

REPO = Path(__file__).resolve().parents[2]


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def build_and_install(tmp_path: Path) -> Path:
    """Build the wheel from a copy of the package sources and install it into ``tmp_path/site``."""
    src, dist, site = tmp_path / "src", tmp_path / "dist", tmp_path / "site"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "zoo", src / "zoo", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src], cwd=tmp_path)
    (wheel,) = dist.glob("zoo-*.whl")
    run([*pip, "install", "--no-deps", "--no-index", "--target", site, wheel], cwd=tmp_path)
    return site


@pytest.mark.slow  # a fresh virtual environment and a wheel build: half a minute on 2 CPU cores
def test_wheel_installs_and_zoo_train_uses_the_packaged_recipe(cifar_dir, tmp_path):
    site = build_and_install(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("ZOO_RUN_DIR", None)

    imported = run([sys.executable, "-c", "import zoo; print(zoo.__file__)"], cwd=work, env=env).stdout.strip()
    assert Path(imported).resolve() == (site / "zoo" / "__init__.py").resolve(), imported   # not the checkout
    shipped = sorted(p.name for p in (site / "zoo" / "configs").glob("*.yaml"))
    assert shipped == sorted(p.name for p in (REPO / "zoo" / "configs").glob("*.yaml"))
    weights = sorted(str(p.relative_to(site / "zoo")) for p in (site / "zoo" / "weights").rglob("*") if p.is_file())
    assert weights and weights == sorted(str(p.relative_to(REPO / "zoo")) for p in (REPO / "zoo" / "weights").rglob("*")
                                         if p.is_file())   # the Hub folders: config.json, model.safetensors, README.md
    (dist_info,) = site.glob("zoo-*.dist-info")   # the version is zoo.__version__, written once
    version = run([sys.executable, "-c", "import zoo; print(zoo.__version__)"], cwd=work, env=env).stdout.strip()
    assert dist_info.name == f"zoo-{version}.dist-info" and list(dist_info.rglob("LICENSE"))

    done = run([site / "bin" / "zoo-train", "--model", "vit_nano", "--data-dir", cifar_dir,
                "--cache-dir", tmp_path / "cache", "--max-train-images", "256", "--max-test-images", "64",
                "--epochs", "1", "--batch-size", "64", "--set", "val_size=64", "--out", tmp_path / "runs"],
               cwd=work, env=env)
    run_dir = Path(done.stdout.strip().splitlines()[-1])
    assert run_dir.parent == tmp_path / "runs" / "vit_nano" and (run_dir / "summary.json").is_file()
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    recipe = yaml.safe_load((REPO / "zoo" / "configs" / "vit_nano.yaml").read_text())
    defaults = Recipe()
    assert recipe["model_args"]["drop_path_rate"] > 0 and recipe["warmup_epochs"] != defaults.warmup_epochs
    assert recipe["augment"] != asdict(defaults.augment)        # the recipe differs from the built-in defaults
    assert config["model_args"] == recipe["model_args"]
    assert config["augment"] == {**asdict(defaults.augment), **recipe["augment"]}   # recipe over the defaults
    for key in ("lr", "weight_decay", "warmup_epochs", "min_lr_ratio", "label_smoothing"):
        assert config[key] == recipe[key], key
    assert (config["epochs"], config["batch_size"], config["val_size"]) == (1, 64, 64)    # flags and --set
