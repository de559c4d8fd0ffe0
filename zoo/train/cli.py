"""Train a zoo model on CIFAR-10 (or an ImageFolder tree) on Lightning Fabric; prints the run directory last.

    python train.py --model vit_tiny
    python train.py --model vit_tiny --data-dir DATA --max-time 00:00:10:00
    python train.py --model vit_tiny --resume auto          # continue the newest run of vit_tiny

Every recipe key is a flag (weight_decay: --weight-decay, augment.mixup_alpha: --augment.mixup-alpha). Precedence,
lowest first: zoo/configs/<model>.yaml, --config FILE, --set KEY=VALUE, explicit flags."""

from __future__ import annotations

import argparse
import json
import sys

from zoo.runtime.console import OneLineParser, error_line, line_buffered_output, parse_or_exit_code

CLI_ONLY = ("config", "set", "list_models", "print_config")  # flags that are not recipe keys


def _yaml_value(text: str):
    from zoo.train.recipe import parse_yaml

    try:
        return parse_yaml(text, repr(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _flag_options(annotation: str) -> dict:
    """argparse options of a recipe field from its type: int / float / str values as such, a bool a --x / --no-x
    switch, a bool-or-word a flag with an optional value, anything else a YAML value (the --set reader)."""
    if annotation == "bool":
        return {"action": argparse.BooleanOptionalAction}
    if "bool" in annotation:
        return {"nargs": "?", "const": True, "type": _yaml_value}
    if annotation == "list":
        return {"action": "append"}
    plain = {"int": int, "float": float, "str": str}.get(annotation.removesuffix(" | None"))
    return {"type": plain or _yaml_value}


def build_parser() -> argparse.ArgumentParser:
    """train.py's flags: one per recipe key (``zoo.train.recipe.Recipe``'s fields: doc line, type, default)."""
    from zoo.train.recipe import recipe_fields

    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list-models", action="store_true",
                   help="list the registered models with their parameters and FLOPs per 32x32 image, and exit")
    p.add_argument("--config", help="a YAML recipe file layered over configs/<model>.yaml, or a shipped one by name "
                   "(cpu_budget, gpu_speedrun) (default: none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key (dotted for nested: augment.mixup_alpha=0.2); repeatable")
    p.add_argument("--print-config", "--print_config", action="store_true",
                   help="print the resolved recipe as YAML (a run's config.yaml before the run's choices) and exit")
    for key, f in recipe_fields():
        default = f" (default: the model's recipe or --config, else {json.dumps(f.default_factory())})"
        help_text = (f.metadata["doc"] + (default if key != "model" else "")).replace("%", "%%")
        p.add_argument("--" + f.metadata.get("flag", key).replace("_", "-"), dest=key, help=help_text,
                       **_flag_options(f.type))
    return p


def main(argv=None) -> int:
    from zoo.runtime.console import zoo_warnings_in_one_line

    line_buffered_output()
    zoo_warnings_in_one_line("train.py")
    args = parse_or_exit_code(lambda argv: build_parser().parse_args(argv), argv)
    if isinstance(args, int):
        return args
    if args.list_models:
        from zoo.models import models_table

        print(models_table())
        return 0
    from zoo.runtime.device import resolve_accelerator
    from zoo.train.metrics import require_loggers
    from zoo.train.recipe import resolve_config

    try:  # argument errors come before Lightning is imported or any data is read
        recipe = resolve_config(args.model, args.config, args.set,
                                {k: v for k, v in vars(args).items() if k not in CLI_ONLY})
        if args.print_config:
            print(recipe.to_yaml(), end="")
            return 0
        resolve_accelerator(recipe.accelerator, recipe.devices)
        require_loggers(recipe.loggers)
    except ValueError as err:
        return error_line("train.py", err)
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from zoo.runtime.distributed import is_global_zero
    from zoo.train import loop
    from zoo.train.preemption import Interrupted, Preempted

    try:
        run_dir = loop.fit(recipe)
    except (Preempted, Interrupted) as stop:  # a signal in training (last.ckpt saved at that step) or outside it
        if is_global_zero():  # one line for the run, not one a process
            print(f"train.py: {stop}", file=sys.stderr)
        return stop.code
    except KeyboardInterrupt:  # Ctrl-C where fit had no handler of its own
        print("train.py: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except (ValueError, MisconfigurationException) as err:  # user errors, DataError included
        return error_line("train.py", err)
    except loop.NonFiniteLossError as err:
        return error_line("train.py", err, 1)
    print(run_dir)
    return 0
