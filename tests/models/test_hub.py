"""The shipped weights through the ecosystem's loaders: each folder ``zoo/weights/<name>/`` is in the Hub's layout,
``timm.create_model("local-dir:...")`` and ``torch.hub.load(<checkout>, name, source="local")`` give the
predictions of ``zoo.create_model(name, pretrained=True)`` on 1,000 real test images, whose top-1 is the model
card's; hubconf.py has an entry point per registered model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import timm
import torch
from timm.data import resolve_model_data_config

import zoo
from zoo.models import model_card, shipped_models
from zoo.models.registry import WEIGHTS_DIR

REPO = Path(__file__).resolve().parents[2]


def test_hubconf_has_an_entry_point_per_registered_model():
    spec = importlib.util.spec_from_file_location("hubconf", REPO / "hubconf.py")
    hubconf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hubconf)
    # what torch.hub.list shows (it reads GitHub repositories only): the public callables
    assert [f for f in dir(hubconf) if callable(getattr(hubconf, f)) and not f.startswith("_")] == zoo.list_models()
    model = torch.hub.load(str(REPO), "vit_tiny", source="local", num_classes=3)
    assert model.head.out_features == 3 and model.zoo_name == "vit_tiny"


@pytest.mark.parametrize("name", shipped_models())
def test_shipped_folder_is_in_the_hub_layout(name):
    folder = WEIGHTS_DIR / name
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    card = config["model_card"]
    assert config["architecture"] == f"zoo_{name}" and config["num_classes"] == card["num_classes"]
    assert config["pretrained_cfg"]["label_names"] == config["label_names"] == card["class_names"]
    assert config["pretrained_cfg"]["mean"] == card["mean"] and config["pretrained_cfg"]["license"] == "apache-2.0"
    assert (folder / "README.md").read_text().startswith("---\n")


def test_local_dir_and_torch_hub_predict_as_the_shipped_weights(spread_test_images):
    name = "hybrid_tiny"
    card = model_card(name)
    reference = zoo.create_model(name, pretrained=True).eval()
    from_dir = timm.create_model(f"local-dir:{WEIGHTS_DIR / name}", pretrained=True).eval()
    from_hub = torch.hub.load(str(REPO), name, source="local", pretrained=True).eval()
    data = resolve_model_data_config(from_dir)
    # timm leaves config.json's lists as lists
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()} == resolve_model_data_config(reference)
    # 100 real test images: the three loads must agree to the bit (test_pretrained checks the card's top-1 on all
    # of its check images)
    images, labels = spread_test_images(card["class_names"], 100)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (data["mean"], data["std"]))
    x = (images.float() / 255 - mean) / std
    with torch.no_grad():
        expected = reference(x)
        torch.testing.assert_close(from_dir(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(from_hub(x), expected, rtol=0, atol=0)
    assert (expected.argmax(1) == labels).float().mean().item() > 0.5  # the shipped model, not an untrained one
