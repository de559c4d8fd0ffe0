"""Pretrained weights through timm's machinery: a safetensors file in a zoo model's pretrained cfg loads with
``pretrained=True`` in both ``zoo.create_model`` and ``timm.create_model``, adapting ``num_classes`` and
``in_chans`` as timm does (checked against what that adaptation means: a new head; a grey image through the
adapted model equals the grey image repeated over RGB through the original). The weights the zoo ships are
checked against their model cards on real test images."""

from __future__ import annotations

import pytest
import timm
import torch
from conftest import slow_except
from safetensors.torch import save_file
from timm.data import resolve_model_data_config

import zoo
from zoo.models import model_card, shipped_models


def _saved(model, path) -> dict:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return {"file": str(path)}


@pytest.mark.parametrize("name", ["vit_nano", "hybrid_tiny", "resnet18"])
def test_pretrained_file_loads_identically_in_zoo_and_timm(name, tmp_path):
    source = zoo.create_model(name).eval()
    overlay = _saved(source, tmp_path / "w.safetensors")
    ours = zoo.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay).eval()
    theirs = timm.create_model(f"zoo_{name}", pretrained=True, pretrained_cfg_overlay=overlay).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = source(x)
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(theirs(x), expected, rtol=0, atol=0)


def test_pretrained_with_other_num_classes_keeps_the_body_and_starts_a_new_head(tmp_path):
    source = zoo.create_model("hybrid_tiny").eval()
    model = zoo.create_model("hybrid_tiny", pretrained=True, num_classes=3,
                             pretrained_cfg_overlay=_saved(source, tmp_path / "w.safetensors")).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), source.forward_features(x))
    assert model.head.out_features == 3 and model(x).shape == (2, 3)


@pytest.mark.parametrize("name", ["hybrid_tiny", "vit_nano", "resnet18"])
def test_pretrained_to_one_channel_equals_grey_replicated_over_rgb(name, tmp_path):
    source = zoo.create_model(name).eval()
    grey_model = zoo.create_model(name, pretrained=True, in_chans=1,
                                  pretrained_cfg_overlay=_saved(source, tmp_path / "w.safetensors")).eval()
    grey = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(grey_model(grey), source(grey.expand(-1, 3, -1, -1)), rtol=1e-4, atol=1e-4)


def test_models_without_weights_say_so():
    assert "vit_tiny" not in shipped_models()
    with pytest.raises(ValueError, match="no pretrained weights.*pretrained=False"):
        zoo.create_model("vit_tiny", pretrained=True)
    with pytest.raises(ValueError, match="no pretrained weights"):
        timm.create_model("zoo_vit_tiny", pretrained=True)


@pytest.mark.parametrize("name", slow_except(shipped_models(), ("hybrid_tiny",)))
def test_shipped_weights_match_their_model_card(name, spread_test_images):
    card = model_card(name)
    ours = zoo.create_model(name, pretrained=True).eval()
    theirs = timm.create_model(f"zoo_{name}", pretrained=True).eval()
    data = resolve_model_data_config(theirs)
    assert data["input_size"] == (3, card["img_size"], card["img_size"])
    images, labels = spread_test_images(card["class_names"], card["check_images"])
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (data["mean"], data["std"]))
    x = (images.float() / 255 - mean) / std
    with torch.no_grad():
        logits = ours(x)
        torch.testing.assert_close(theirs(x), logits, rtol=0, atol=0)
    top1 = (logits.argmax(1) == labels).float().mean().item()
    assert top1 == pytest.approx(card["check_top1"], abs=0.005)  # the same images; decoders may differ by a pixel
    assert top1 == pytest.approx(card["test_top1"], abs=0.04)  # 1,000 of the 10,000: ~3.5 standard errors
    assert sum(p.numel() for p in ours.parameters()) == card["params"]
