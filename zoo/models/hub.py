"""Trained weights in the Hugging Face Hub's folder layout, the one timm reads with ``local-dir:DIR`` (and
``hf-hub:USER/REPO`` once the folder is uploaded): ``config.json`` in timm's format (``architecture`` = ``zoo_<name>``,
``num_classes``, ``label_names``, ``model_args`` and the pretrained cfg: input size, mean / std, crop, classifier,
license) with the zoo's model card under ``model_card`` (accuracies, recipe, command, machine), the weights as
``model.safetensors``, and ``README.md``, the model card in the Hub's front-matter format. The weights the zoo ships
are such folders, ``zoo/weights/<name>/``; ``zoo.train.publish`` writes them."""

from __future__ import annotations

from .registry import default_cfgs

HUB_README = "README.md"
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
# the cfg keys that describe the weights' model rather than its training data
_MODEL_KEYS = ("fixed_input_size", "interpolation", "crop_pct", "crop_mode", "first_conv", "classifier", "license")


def hub_config(card: dict) -> dict:
    """config.json of the weights described by ``card`` (a model card from ``zoo.train.publish.build_card``):
    what ``timm.create_model("local-dir:DIR")`` builds the model and its data config from."""
    name, size = card["model"], card["img_size"]
    registered = default_cfgs[f"zoo_{name}"]
    pretrained_cfg = {key: registered[key] for key in _MODEL_KEYS}
    pretrained_cfg.update(
        input_size=[3, size, size], mean=list(card["mean"]), std=list(card["std"]),
        num_classes=card["num_classes"], label_names=list(card["class_names"]),
        # the final feature map's size is the registered one only at the 32x32 the cfg is written for
        pool_size=registered["pool_size"] if size == 32 else None, notes=[card["command"]])
    return {"architecture": f"zoo_{name}", "num_classes": card["num_classes"],
            "label_names": list(card["class_names"]), "model_args": dict(card["model_args"]),
            "pretrained_cfg": pretrained_cfg, "model_card": card}


def hub_readme(card: dict) -> str:
    """README.md: the model card with the Hub's front matter (timm's ``generate_readme``), its figures and usage."""
    from timm.models._hub import generate_readme

    name = card["model"]
    dataset = "CIFAR10" if tuple(card["class_names"]) == CIFAR10_CLASSES else None
    trained_on = "CIFAR-10" if dataset else f"a {card['num_classes']}-class image folder"
    details = {
        "Model Type": "Image classification",
        "Model Stats": {"Params (M)": round(card["params"] / 1e6, 2),
                        "FLOPs per image (M)": round(card["flops"] / 1e6, 1),
                        "Image size": f"{card['img_size']} x {card['img_size']}"},
        "Test top-1": f"{card['test_top1']:.4f} on {card['test_images']:,} test images "
                      f"({card['test_top1_tta']:.4f} with test-time augmentation level {card['tta_level']})",
        "Training": f"{card['epochs']} epochs, {card['global_step']} steps, {card['precision']}, "
                    f"{card['wall_time_s']} s on {card['machine']}",
        "Command": f"`{card['command']}`",
    }
    if dataset:
        details["Dataset"] = dataset
    usage = (
        "```python\nimport timm\nimport zoo  # registers the zoo's architectures in timm\n\n"
        f'model = timm.create_model("hf-hub:USER/REPO", pretrained=True).eval()  # or "local-dir:path/to/{name}"\n'
        "data = timm.data.resolve_model_data_config(model)  # input size, mean / std the weights were trained with\n"
        "```\n")
    return generate_readme({
        "tags": ["image-classification", "timm", "zoo"], "license": default_cfgs[f"zoo_{name}"]["license"],
        "description": f"A zoo `{name}` trained from scratch on {trained_on}.", "details": details,
        "usage": usage}, f"zoo_{name}")
