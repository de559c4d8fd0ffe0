"""Where a model's training time goes: forward + backward of the model and of copies with every module of one class
replaced by ``nn.Identity`` (a shape-keeping block: CBAM, a transformer block), timed side by side
(``interleaved_medians``); a class's share is the model's time less the copy's. The optimizer step is timed apart.

    python -m zoo.bench.parts --model hybrid_tiny --drop CBAM Block --precision bf16-mixed
    python -m zoo.bench.parts --model hybrid_tiny --model-args '{"stem_chs": [64], "embed_dim": 128, "num_heads": 4}'
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.nn.functional as F
from torch import nn

from ..models import create_model
from ..runtime.machine import machine_name
from .timing import autocast_for, interleaved_medians


def without(model: nn.Module, class_name: str) -> nn.Module:
    """A copy of ``model`` with every submodule whose class is named ``class_name`` replaced by ``nn.Identity``;
    ValueError if there is none."""
    model = copy.deepcopy(model)
    found = 0
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child).__name__ == class_name:
                setattr(parent, name, nn.Identity())
                found += 1
    if not found:
        raise ValueError(f"{type(model).__name__} has no {class_name} module to remove")
    return model


def time_parts(model: nn.Module, drop: list[str], *, batch: int = 128, precision: str = "bf16-mixed",
               channels_last: bool = True, repeats: int = 5) -> dict[str, float]:
    """Seconds per forward + backward of ``model`` ("model") and of ``without(model, name)`` for each name in
    ``drop`` ("without <name>"), on random 32x32 images at ``batch``, and of one AdamW step ("optimizer")."""
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(batch, 3, 32, 32).contiguous(memory_format=memory_format)
    y = torch.randint(0, 10, (batch,))

    def step_of(net: nn.Module):
        net = net.train().to(memory_format=memory_format)

        def step():
            with autocast_for(x.device, precision):
                loss = F.cross_entropy(net(x).float(), y)
            loss.backward()
            net.zero_grad(set_to_none=True)
        return step

    candidates = {"model": step_of(model), **{f"without {name}": step_of(without(model, name)) for name in drop}}
    stepped = copy.deepcopy(model)  # the steps above clear their model's gradients
    for p in stepped.parameters():
        p.grad = torch.randn_like(p)
    candidates["optimizer"] = torch.optim.AdamW(stepped.parameters()).step
    return interleaved_medians(candidates, repeats=repeats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="hybrid_tiny", help="registered model name")
    p.add_argument("--model-args", default="{}", help='create_model keyword arguments as JSON, e.g. \'{"depth": 4}\'')
    p.add_argument("--drop", nargs="+", default=["CBAM", "Block"], help="module class names to time apart")
    p.add_argument("--precision", default="bf16-mixed", choices=["32", "bf16-mixed"])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    model = create_model(args.model, **json.loads(args.model_args))
    seconds = time_parts(model, args.drop, batch=args.batch, precision=args.precision, repeats=args.repeats)
    ms = {k: round(v * 1e3, 1) for k, v in seconds.items()}
    shares = {name: round(ms["model"] - ms[f"without {name}"], 1) for name in args.drop}
    print(json.dumps({"machine": machine_name(), "model": args.model, "model_args": json.loads(args.model_args),
                      "precision": args.precision, "batch": args.batch, "ms": ms, "ms_of": shares}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
