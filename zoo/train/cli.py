"""Train a zoo model on CIFAR-10 (or an ImageFolder tree) with Lightning; prints the run directory last.

    python train.py --model vit_tiny
    python train.py --model vit_tiny --data-dir ../shared/data/cifar10 --max-time 00:00:10:00
    python train.py --model vit_tiny --resume auto          # continue the newest run of vit_tiny

Recipe precedence, lowest first: configs/<model>.yaml, --config FILE, --set key=value, explicit flags."""

from __future__ import annotations

import argparse
import json
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line on stderr (and exit code 2), as every other user
    error of the zoo's programs, instead of the usage block followed by the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _compile_mode(value: str) -> bool | str:
    if value != "regions":
        raise argparse.ArgumentTypeError(f"--compile takes no value or 'regions', got {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from zoo.train.recipe import recipe_help

    p = OneLineParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="recipe keys (configs/*.yaml, --config, --set KEY=VALUE):\n" + recipe_help())
    p.add_argument("--model", help="registered model name (see --list-models); required")
    p.add_argument("--list-models", action="store_true",
                   help="list the registered models with their parameters and FLOPs per 32x32 image, and exit")
    p.add_argument("--config", help="a YAML recipe file layered over configs/<model>.yaml (default: none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (dotted for nested: augment.mixup_alpha=0.2); repeatable")
    p.add_argument("--data-dir", help="ImageFolder tree with train/ and test/, or a folder holding "
                   "cifar-10-batches-py (./data with a torchvision download when unset)")
    p.add_argument("--download", action="store_true", default=None, help="download CIFAR-10 into --data-dir")
    p.add_argument("--epochs", type=int, help="training epochs (the LR schedule spans them)")
    p.add_argument("--batch-size", type=int, help="global training batch size, split across devices and nodes")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--precision",
                   help="auto (GPU: bf16-mixed or 16-mixed; CPU: bf16-mixed with native bf16, else 32), 32, "
                   "bf16-mixed, 16-mixed")
    p.add_argument("--accelerator", help="auto, cpu, gpu, mps (Apple silicon)")
    p.add_argument("--devices", help="number of devices, -1 (all), a device list like 0,1, or auto")
    p.add_argument("--strategy", help="auto, ddp, ...")
    p.add_argument("--num-nodes", type=int, help="machines in a multi-node run")
    p.add_argument("--compile", nargs="?", const=True, type=_compile_mode, metavar="regions",
                   help="torch.compile the whole model, or with 'regions' each CBAM and transformer block")
    p.add_argument("--channels-last", action="store_true", default=None,
                   help="channels-last memory format (automatic for the conv models resnet* and hybrid*)")
    p.add_argument("--max-time", help="wall-clock budget DD:HH:MM:SS, above zero; the LR schedule is fitted to it")
    p.add_argument("--limit-train-batches", help="integer = batches per epoch, 0.25 = a fraction")
    p.add_argument("--limit-val-batches", help="as --limit-train-batches, for validation")
    p.add_argument("--limit-test-batches", help="as --limit-train-batches, for the test")
    p.add_argument("--max-train-images", type=int, help="train on a seeded subset of this many images")
    p.add_argument("--max-test-images", type=int, help="test on a seeded subset of this many images")
    p.add_argument("--cache-dir", help="where the decoded uint8 cache goes ($XDG_CACHE_HOME/zoo/... or "
                   "~/.cache/zoo/... when unset, never the data folder)")
    p.add_argument("--seed", type=int, help="seeds the split, the subsets, the shuffling and the weights")
    p.add_argument("--out", help="root folder of run directories: the run is written to OUT/<model>/<run-id>/")
    p.add_argument("--logger", dest="loggers", action="append", metavar="NAME",
                   help="also log to this Lightning logger: tensorboard (into RUN/tensorboard/), wandb, mlflow, "
                   "comet; repeatable or comma-separated; metrics.csv is always written")
    p.add_argument("--resume", metavar="PATH|auto", help="continue a run directory / checkpoint of the same model "
                   "and model arguments, or (auto) the newest run of --model under --out")
    p.add_argument("--ckpt-every-n-steps", type=int, help="also write checkpoints/last.ckpt every N steps")
    p.add_argument("--ckpt-every-minutes", type=float, help="write checkpoints/last.ckpt every M minutes of training "
                   "(default 2) and at the end")
    p.add_argument("--init-from", help="start a new run from a zoo checkpoint or a timm ViT state_dict; prints "
                   "what it loaded and refuses under half of the model's parameter elements")
    p.add_argument("--init-partial", action="store_true", default=None,
                   help="let --init-from load under half of the model's parameter elements")
    _show_defaults(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _show_defaults(p: argparse.ArgumentParser) -> None:
    """Append to each recipe flag's help where its default comes from: the model's recipe, else the built-in."""
    from dataclasses import MISSING, fields

    from zoo.train.recipe import Recipe

    builtin = {f.name: f.default for f in fields(Recipe) if f.default is not MISSING}
    for action in p._actions:
        if action.dest in builtin and action.dest != "model" and action.help:
            action.help += f" (default: the model's recipe or --config, else {json.dumps(builtin[action.dest])})"


def list_models() -> str:
    """One line per registered model: name, parameters, forward FLOPs per 32x32 image, shipped weights."""
    from zoo.models import create_model, list_models, model_info, shipped_models

    lines = [f"{'model':16} {'params':>12} {'FLOPs/image':>14}  weights"]
    for name in list_models():
        info = model_info(create_model(name))
        shipped = "shipped" if name in shipped_models() else "-"
        lines.append(f"{name:16} {info['params']:>12,} {info['flops']:>14,}  {shipped}")
    return "\n".join(lines)


def parse_or_exit_code(parse, argv) -> argparse.Namespace | int:
    """``parse(argv)``, or the exit code argparse chose (2 for a bad command line, 0 for --help)."""
    try:
        return parse(argv)
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else 0


def main(argv=None) -> int:
    args = parse_or_exit_code(parse_args, argv)
    if isinstance(args, int):
        return args
    if args.list_models:
        print(list_models())
        return 0
    from zoo.train.device import resolve_accelerator
    from zoo.train.loggers import require_loggers
    from zoo.train.recipe import resolve_config

    try:  # argument errors come before Lightning is imported or any data is read
        flags = {k: v for k, v in vars(args).items() if k not in ("model", "config", "set", "list_models")}
        recipe = resolve_config(args.model, args.config, args.set, flags)
        resolve_accelerator(recipe.accelerator, recipe.devices)
        require_loggers(recipe.loggers)
    except ValueError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from zoo.train.fit import fit
    from zoo.train.module import NonFiniteLossError
    from zoo.train.preemption import Preempted

    try:
        run_dir = fit(recipe)
    except Preempted as stop:  # SIGTERM / SIGINT / SIGUSR1 in training: last.ckpt saved at that step
        print(f"train.py: {stop}", file=sys.stderr)
        return stop.code
    except KeyboardInterrupt:  # Ctrl-C outside training (decoding, the precision probe, the test)
        print("train.py: interrupted (Ctrl-C); a run with a checkpoints/last.ckpt continues with --resume auto",
              file=sys.stderr)
        return 130
    except (ValueError, MisconfigurationException) as err:  # user errors, DataError included
        print(f"train.py: error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 1
    print(run_dir)
    return 0
