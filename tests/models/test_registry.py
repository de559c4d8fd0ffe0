"""zoo's model registry and its mirror in timm's: names, errors, pretrained cfgs, timm.data resolution."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.data import resolve_data_config

import zoo

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # the usual published CIFAR-10 channel statistics
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def test_list_models_sorted_and_contains_vits():
    names = zoo.list_models()
    assert names == sorted(names) and {"vit_nano", "vit_tiny", "vit_small"} <= set(names)


def test_unknown_name_lists_close_matches():
    with pytest.raises(ValueError, match=r"unknown model 'vit_tinny'; did you mean .*vit_tiny") as err:
        zoo.create_model("vit_tinny")
    message = str(err.value)
    assert "'vit_tinny'" in message and "did you mean" in message and "vit_tiny" in message
    with pytest.raises(ValueError, match="unknown model"):
        zoo.create_model("no_such_thing_at_all")


def test_zoo_prefix_and_kwargs_pass_through():
    model = zoo.create_model("zoo_vit_nano", num_classes=3, img_size=16)
    assert model.img_size == (16, 16) and model(torch.randn(1, 3, 16, 16)).shape == (1, 3)


def test_every_zoo_model_is_in_timm():
    assert set(timm.list_models("zoo_*")) >= {f"zoo_{name}" for name in zoo.list_models()}


def test_timm_create_model_and_pretrained_cfg():
    model = timm.create_model("zoo_vit_tiny", num_classes=10)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    cfg = timm.models.get_pretrained_cfg("zoo_vit_tiny")
    assert cfg.input_size == (3, 32, 32) and cfg.num_classes == 10
    assert cfg.mean == pytest.approx(CIFAR10_MEAN) and cfg.std == pytest.approx(CIFAR10_STD)
    assert isinstance(model.get_submodule(cfg.first_conv), torch.nn.Conv2d)
    assert isinstance(model.get_submodule(cfg.classifier), torch.nn.Linear)
    data = resolve_data_config({}, model=model)  # what timm's data pipeline would use for this model
    assert data["input_size"] == (3, 32, 32) and data["mean"] == pytest.approx(CIFAR10_MEAN)


@pytest.mark.parametrize("name", zoo.list_models())
def test_pretrained_cfg_names_exist_in_every_model(name):
    cfg = timm.models.get_pretrained_cfg(f"zoo_{name}")
    model = zoo.create_model(name)
    assert model.get_submodule(cfg.first_conv) is not None and model.get_submodule(cfg.classifier) is not None
