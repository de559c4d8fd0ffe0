"""Settings that reach the model, the loss or the optimizer are checked when the recipe is resolved: each bad
one ends train.py with one line on stderr and exit code 2 before the run starts (``zoo.train.loop.fit`` is
replaced by a failure here, so a check that came later, after the data were decoded, fails the test). A
``--set`` value and a config file are read by one YAML loader, so a tag that would build a Python object is
refused the same way in both, and runs nothing."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import train  # noqa: E402

PAYLOAD = '!!python/object/apply:os.system ["touch {marker}"]'

CASES = [
    ("depth a string, --set", ["--set", "model_args.depth=x"], r"model_args.depth of vit_nano must be int, got 'x'"),
    ("depth a string, config", ["--config", "{config}"], r"model_args.depth of vit_nano must be int, got 'x'"),
    ("depth a list", ["--set", "model_args.depth=[2, 3]"], r"model_args.depth of vit_nano must be int, got \[2, 3\]"),
    ("depth a float", ["--set", "model_args.depth=2.5"], r"model_args.depth .* must be int, got 2.5"),
    ("img_size in model_args", ["--set", "model_args.img_size=[32]"],
     r"model_args.img_size of vit_nano must be int or tuple\[int, int\], got \[32\]"),
    ("unknown model argument", ["--set", "model_args.dpeth=3"],
     r"vit_nano takes no argument model_args.dpeth \(did you mean model_args.depth\?\); valid: attn_drop_rate, "
     r"backend, depth, .*qkv_bias, reg_tokens, rel_pos_bias$"),
    ("another model's argument", ["--model", "resnet18", "--set", "model_args.embed_dim=64"],
     r"resnet18 takes no argument model_args.embed_dim.*; valid: .*drop_path_rate"),
    ("label_smoothing 2", ["--set", "label_smoothing=2"], r"label_smoothing must lie in \[0, 1\), got 2.0"),
    ("label_smoothing 1", ["--set", "label_smoothing=1"], r"label_smoothing must lie in \[0, 1\), got 1.0"),
    ("label_smoothing -0.1", ["--set", "label_smoothing=-0.1"], r"label_smoothing must be a non-negative number"),
    ("lr .nan", ["--set", "lr=.nan"], r"lr must be a finite number, got nan"),
    ("lr .inf", ["--set", "lr=.inf"], r"lr must be a finite number, got inf"),
    ("--lr inf", ["--lr", "inf"], r"lr must be a finite number, got inf"),
    ("--lr 0", ["--lr", "0"], r"lr must be above zero, got 0.0"),
    ("weight_decay .nan", ["--set", "weight_decay=.nan"], r"weight_decay must be a finite number, got nan"),
    ("cutout larger than the image", ["--set", "augment.cutout=33"],
     r"augment.cutout must be at most img_size \(32\), got 33"),
    ("cutout larger than a smaller image", ["--set", "img_size=16", "--set", "augment.cutout=20"],
     r"augment.cutout must be at most img_size \(16\), got 20"),
    ("a Python tag in --set", ["--set", "epochs=" + PAYLOAD],
     r"--set epochs=.* is not valid YAML: could not determine a constructor for the tag "
     r"'tag:yaml.org,2002:python/object/apply:os.system'$"),
    ("a Python tag in a config", ["--config", "{tagged}"],
     r"config file .*tagged.yaml is not valid YAML: could not determine a constructor for the tag "
     r"'tag:yaml.org,2002:python/object/apply:os.system'$"),
]


@pytest.fixture
def places(tmp_path) -> dict[str, str]:
    marker = tmp_path / "marker"
    (tmp_path / "depth.yaml").write_text('model_args: {depth: "x"}\n')
    (tmp_path / "tagged.yaml").write_text("epochs: " + PAYLOAD.format(marker=marker) + "\n")
    return {"config": str(tmp_path / "depth.yaml"), "tagged": str(tmp_path / "tagged.yaml"), "marker": str(marker)}


@pytest.mark.parametrize("what, args, match", CASES, ids=[c[0] for c in CASES])
def test_a_bad_setting_is_one_line_before_the_run_starts(what, args, match, places, tmp_path, capsys, monkeypatch):
    import zoo.train.loop

    monkeypatch.setattr(zoo.train.loop, "fit", lambda recipe: pytest.fail("the run started"))
    model = [] if "--model" in args else ["--model", "vit_nano"]
    argv = [*model, *[a.format(**places) for a in args], "--data-dir", str(tmp_path / "no-data"), "--out",
            str(tmp_path / "runs")]
    code = train.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert re.search(match, err.strip()), (match, err)
    assert not Path(places["marker"]).exists() and not (tmp_path / "runs").exists()


def test_a_python_tag_reads_the_same_from_a_config_file_and_from_set(places, capsys):
    messages = []
    for args in (["--config", places["tagged"]], ["--set", "epochs=" + PAYLOAD.format(marker=places["marker"])]):
        assert train.main(["--model", "vit_nano", *args]) == 2
        messages.append(capsys.readouterr().err.strip().split(" is not valid YAML: ")[1])
    assert messages[0] == messages[1]
    assert not Path(places["marker"]).exists()


def test_good_model_arguments_pass(tmp_path):
    """The types the checks accept: an int for a float, a YAML list for a tuple, null for an optional int."""
    from zoo.train.recipe import resolve_config

    recipe = resolve_config("hybrid_tiny", None, ["model_args.stem_chs=[16, 32]", "model_args.drop_path_rate=0",
                                                  "model_args.depth=1"])
    assert recipe.model_args == {"drop_path_rate": 0, "stem_chs": [16, 32], "depth": 1}
    assert resolve_config("vit_nano", None, ["model_args.local_window=null", "augment.cutout=32"]).augment.cutout == 32
