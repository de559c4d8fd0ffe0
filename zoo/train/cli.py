"""Train a zoo model on CIFAR-10 (or an ImageFolder tree) with Lightning; prints the run directory last.

    python train.py --model vit_tiny
    python train.py --model vit_tiny --data-dir ../shared/data/cifar10 --max-time 00:00:10:00
    python train.py --model vit_tiny --resume auto          # continue the newest run of vit_tiny

Recipe precedence, lowest first: configs/<model>.yaml, --config FILE, --set key=value, explicit flags."""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    from zoo.train.recipe import recipe_help

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="recipe keys (configs/*.yaml, --config, --set KEY=VALUE):\n" + recipe_help())
    p.add_argument("--model", help="registered model name (zoo.list_models())")
    p.add_argument("--config", help="a YAML recipe file layered over configs/<model>.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (dotted for nested: augment.mixup_alpha=0.2); repeatable")
    p.add_argument("--data-dir", help="ImageFolder tree with train/ and test/, or a folder holding "
                   "cifar-10-batches-py (default ./data with a torchvision download)")
    p.add_argument("--download", action="store_true", default=None, help="download CIFAR-10 into --data-dir")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--precision",
                   help="auto (GPU: bf16-mixed or 16-mixed; CPU: bf16-mixed with native bf16, else 32), 32, "
                   "bf16-mixed, 16-mixed")
    p.add_argument("--accelerator", help="auto, cpu, gpu")
    p.add_argument("--devices", help="number of devices, or auto")
    p.add_argument("--strategy", help="auto, ddp, ...")
    p.add_argument("--num-nodes", type=int)
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    p.add_argument("--channels-last", action="store_true", default=None,
                   help="channels-last memory format (automatic for the conv models resnet* and hybrid*)")
    p.add_argument("--max-time", help="wall-clock budget DD:HH:MM:SS; the LR schedule is fitted to it")
    p.add_argument("--limit-train-batches", help="integer = batches per epoch, 0.25 = a fraction")
    p.add_argument("--limit-val-batches")
    p.add_argument("--limit-test-batches")
    p.add_argument("--max-train-images", type=int, help="train on a seeded subset of this many images")
    p.add_argument("--max-test-images", type=int, help="test on a seeded subset of this many images")
    p.add_argument("--cache-dir", help="where the decoded uint8 cache goes (default $XDG_CACHE_HOME/zoo/... "
                   "or ~/.cache/zoo/..., never the data folder)")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", help="root of run directories (default runs/)")
    p.add_argument("--resume", metavar="PATH|auto", help="continue a run dir / checkpoint, or the newest run")
    p.add_argument("--ckpt-every-n-steps", type=int, help="also write checkpoints/last.ckpt every N steps")
    p.add_argument("--init-from", help="start from a zoo checkpoint or a timm ViT state_dict")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from zoo.train.fit import fit
    from zoo.train.module import NonFiniteLossError
    from zoo.train.recipe import resolve_config

    try:
        flags = {k: v for k, v in vars(args).items() if k not in ("model", "config", "set")}
        recipe = resolve_config(args.model, args.config, args.set, flags)
        run_dir = fit(recipe)
    except (ValueError, MisconfigurationException) as err:  # user errors, DataError included
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 1
    print(run_dir)
    return 0
