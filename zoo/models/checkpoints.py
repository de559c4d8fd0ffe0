"""Reading trained weights back without Lightning: ``load_run`` rebuilds a trained model from a run directory
or a checkpoint written by ``train.py``; ``load_pretrained`` copies matching weights from a zoo checkpoint or a
timm state_dict, resampling the position embedding. Only torch is needed to read a checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..layers.cbam import current_cbam_keys
from .registry import check_model_args, check_model_fits, create_model, list_models, model_card, shipped_models
from .run_files import read_config, read_summary


def load_checkpoint(path: str | Path) -> dict:
    """torch.load a Lightning checkpoint on CPU; missing / truncated / foreign, or a file that is no PyTorch
    checkpoint at all (a CSV, a YAML file) -> ValueError (one line)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}")
    with open(path, "rb") as f:
        head = f.read(8)
    # torch.save writes a zip archive (b"PK\x03\x04"), before torch 1.6 a pickle (b"\x80"); torch.load reads
    # anything else as a pickle and fails with whatever the bytes happen to mean (IndexError for a CSV)
    if not head.startswith((b"PK\x03\x04", b"\x80")):
        shown = f"it starts with {head!r}" if head else "it is empty"
        raise ValueError(f"{path} is not a PyTorch checkpoint (torch.save writes a zip archive; {shown})")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError / UnpicklingError / EOFError / zipfile errors
        raise ValueError(f"{path} is not a readable PyTorch checkpoint (truncated or corrupt?): "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path} holds a {type(ckpt).__name__}, not a checkpoint dict")
    return ckpt


def _zoo_checkpoint(path: Path) -> dict:
    ckpt = load_checkpoint(path)
    hparams = ckpt.get("hyper_parameters", {})
    if "state_dict" not in ckpt or "model_name" not in hparams:
        raise ValueError(f"{path} is not a zoo training checkpoint (no state_dict / model_name)")
    return ckpt


def _model_state(ckpt: dict) -> dict[str, torch.Tensor]:
    """The wrapped model's weights from an ImageClassifier checkpoint (prefix ``model.`` stripped)."""
    return {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}


def _rebuilt(ckpt_path: Path, ckpt: dict) -> nn.Module:
    """The model a checkpoint's hyper-parameters describe, with its weights; every way the two do not fit (model
    arguments that are not a mapping or that the model does not take, a model too large for this machine, checked
    on the meta device before anything is allocated, weights of another shape or missing) -> ValueError naming
    the file."""
    hp = ckpt["hyper_parameters"]
    name, args, num_classes = hp["model_name"], hp.get("model_args") or {}, hp.get("num_classes")
    try:
        if not isinstance(args, Mapping) or not all(isinstance(key, str) for key in args):
            raise ValueError(f"model_args is {args!r}, expected a mapping of argument names")
        if not isinstance(name, str):
            raise ValueError(f"model_name is {name!r}, expected one of {', '.join(list_models())}")
        if name.removeprefix("zoo_") not in list_models():
            create_model(name)  # the registry's ValueError, with close matches
        check_model_args(name, args, prefix="model_args.")  # an unknown name, which create_model passes to timm
        check_model_fits(name, num_classes=num_classes, **args)
        model = create_model(name, num_classes=num_classes, **args)
    except ValueError as err:
        raise ValueError(f"{ckpt_path}: {err}") from None
    try:
        model.load_state_dict(_model_state(ckpt))
    except (RuntimeError, TypeError, AttributeError) as err:  # missing or unexpected keys, shapes: torch's list
        raise ValueError(f"{ckpt_path} does not hold the weights of {name} with its model_args: "
                         f"{' '.join(str(err).split())[:300]}") from None
    return model


def load_run(path: str | Path) -> tuple[nn.Module, dict]:
    """``(model in eval mode on CPU, meta)`` from a run directory (best.ckpt preferred, else last.ckpt) or a
    .ckpt path. ``meta``: {"summary": summary.json or {}, "config": config.yaml or {}, "ckpt_path",
    "model_name", "model_args", "num_classes", "global_step", "epoch"}. Missing / truncated / foreign
    checkpoints, and hyper-parameters, weights or a config.yaml that do not fit -> ValueError in one line."""
    path = Path(path)
    if path.is_dir():
        ckpts = [path / "checkpoints" / name for name in ("best.ckpt", "last.ckpt")]
        ckpt_path = next((p for p in ckpts if p.is_file()), None)
        if ckpt_path is None:
            raise ValueError(f"{path} holds no checkpoints/best.ckpt or checkpoints/last.ckpt; expected a "
                             "run directory written by train.py or a .ckpt file")
        run_dir = path
    else:
        ckpt_path, run_dir = path, path.parent.parent
    ckpt = _zoo_checkpoint(ckpt_path)
    hp = ckpt["hyper_parameters"]
    summary_file, config_file = run_dir / "summary.json", run_dir / "config.yaml"
    config = read_config(config_file) if config_file.is_file() else {}  # before the model: it may be large
    model = _rebuilt(ckpt_path, ckpt).eval()
    meta = {
        "summary": read_summary(summary_file) if summary_file.is_file() else {},
        "config": config,
        "ckpt_path": str(ckpt_path), "model_name": hp["model_name"],
        "model_args": dict(hp.get("model_args") or {}),
        "num_classes": hp["num_classes"], "global_step": ckpt.get("global_step"), "epoch": ckpt.get("epoch"),
    }
    return model, meta


def load_shipped(name: str) -> tuple[nn.Module, dict]:
    """``(model in eval mode on CPU, meta)`` for a model whose weights ship with the zoo, as ``load_run`` gives
    for a run: ``meta`` has "model_name", "ckpt_path" ("pretrained:<name>"), "summary" (the model card), and
    "config" with the image size and (None) data folder. Unknown / unshipped name -> ValueError."""
    key = name.removeprefix("zoo_")
    card = model_card(key)
    if card is None:
        raise ValueError(f"the zoo ships no weights for {name!r}; shipped: {', '.join(shipped_models()) or 'none'}")
    model = create_model(key, pretrained=True).eval()
    meta = {"model_name": key, "ckpt_path": f"pretrained:{key}", "summary": card, "model_args": {},
            "config": {"img_size": card["img_size"], "data_dir": None}, "num_classes": card["num_classes"],
            "global_step": card.get("global_step"), "epoch": card.get("epochs")}
    return model, meta


def checkpoint_weights(path: str | Path) -> dict:
    """The model weights in a zoo checkpoint (``model.`` prefix stripped) or a timm / plain state_dict file."""
    ckpt = load_checkpoint(path)
    if "state_dict" in ckpt and "hyper_parameters" in ckpt:
        return _model_state(ckpt)
    return ckpt.get("state_dict", ckpt.get("model", ckpt))


def matching_weights(model: nn.Module, source: dict) -> dict[str, torch.Tensor]:
    """The tensors of ``source`` whose name and shape match ``model``'s (a learned ``pos_embed`` of any grid of
    the model's width, which loading resamples). A checkpoint of the hook-based first ``add_cbam`` names its CBAM
    weights otherwise: they are renamed."""
    source = current_cbam_keys(model, source)
    target = model.state_dict()
    return {k: v for k, v in source.items() if isinstance(v, torch.Tensor) and k in target
            and (v.shape == target[k].shape or k == "pos_embed" and v.ndim == target[k].ndim
                 and v.shape[-1] == target[k].shape[-1])}


def load_pretrained(model: nn.Module, path: str | Path) -> list[str]:
    """Copy into ``model`` every weight of a zoo checkpoint or a timm ViT state_dict file whose name and
    shape match; a learned ``pos_embed`` of another grid is kept too, since the zoo ViT's load_state_dict
    resamples it (timm's resample_abs_pos_embed). Returns the names loaded; none matching -> ValueError."""
    loaded = matching_weights(model, checkpoint_weights(path))
    if not loaded:
        raise ValueError(f"--init-from {path}: no weight matches the model by name and shape")
    model.load_state_dict(loaded, strict=False)
    return sorted(loaded)
