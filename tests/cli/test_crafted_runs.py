"""eval.py on run folders whose files were edited by hand or damaged: the checkpoint's ``model_args`` (an unknown
key, a list), its head (another shape, missing), a ``num_classes`` or ``depth`` no machine could hold (refused on
the meta device before anything is allocated), a config.yaml that is not YAML or not a mapping. Each ends eval.py
with one line and exit 2, as torch's own ``load_state_dict`` and YAML's loader would not."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("eval_cli", REPO / "eval.py")
eval_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_cli)


def edit_checkpoints(run: Path, edit) -> None:
    """``edit(ckpt)`` on every checkpoint of ``run``, saved back."""
    for path in (run / "checkpoints").glob("*.ckpt"):
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        edit(ckpt)
        torch.save(ckpt, path)


def hparams(**values):
    return lambda ckpt: ckpt["hyper_parameters"].update(values)


def drop_head(ckpt):
    for key in [k for k in ckpt["state_dict"] if k.startswith("model.head.")]:
        del ckpt["state_dict"][key]


def widen_head(ckpt):
    ckpt["state_dict"]["model.head.weight"] = torch.zeros(11, ckpt["state_dict"]["model.head.weight"].shape[1])


CASES = [
    ("unknown model_args key", hparams(model_args={"dpeth": 2}), r"vit_nano takes no argument model_args.dpeth"),
    ("model_args a list", hparams(model_args=[1, 2]), r"model_args is \[1, 2\], expected a mapping"),
    ("num_classes 10**12", hparams(num_classes=10**12), r"would hold over .* parameter elements .* more than this"),
    ("depth 10**9", hparams(model_args={"depth": 10**9}), r"depth must be an int in \[1, 1,000\], got 1000000000"),
    ("head of another shape", widen_head, r"does not hold the weights of vit_nano .*size mismatch for head.weight"),
    ("head missing", drop_head, r"does not hold the weights of vit_nano .*Missing key\(s\).*head.weight"),
    ("model_name a list", hparams(model_name=["vit_nano"]), r"model_name is \['vit_nano'\], expected one of"),
]
CONFIGS = [
    ("config.yaml malformed", "epochs: [1\n", r"config.yaml is damaged \(not YAML: "),
    ("config.yaml a list", "- 1\n- 2\n", r"config.yaml is damaged \(a YAML list, not a mapping of recipe keys\)"),
    ("config.yaml img_size text", "img_size: big\n", r"config.yaml is damaged \(img_size is 'big', expected int"),
]


@pytest.fixture
def crafted(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("eval"))
    return run


def evaluate(run: Path, cifar_dir: Path, tmp_path: Path, capsys) -> tuple[int, str]:
    code = eval_cli.main(["--checkpoint", str(run), "--data-dir", str(cifar_dir), "--out", str(tmp_path / "eval"),
                          "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("what, edit, match", CASES, ids=[c[0] for c in CASES])
def test_a_crafted_checkpoint_is_one_line(what, edit, match, crafted, cifar_dir, tmp_path, capsys):
    edit_checkpoints(crafted, edit)
    code, err = evaluate(crafted, cifar_dir, tmp_path, capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert re.search(match, err), err
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("what, text, match", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_a_crafted_config_is_one_line(what, text, match, crafted, cifar_dir, tmp_path, capsys):
    (crafted / "config.yaml").write_text(text)
    code, err = evaluate(crafted, cifar_dir, tmp_path, capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert re.search(match, err), err
    assert not (tmp_path / "eval").exists()
