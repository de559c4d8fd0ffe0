"""Train a zoo model on CIFAR-10 (or an ImageFolder tree) with Lightning; prints the run directory last.

    python train.py --model vit_tiny
    python train.py --model vit_tiny --data-dir DATA --max-time 00:00:10:00
    python train.py --model vit_tiny --resume auto          # continue the newest run of vit_tiny

Every recipe key is a flag (weight_decay: --weight-decay, augment.mixup_alpha: --augment.mixup-alpha). Precedence,
lowest first: zoo/configs/<model>.yaml, --config FILE, --set KEY=VALUE, explicit flags."""

from __future__ import annotations

import argparse
import json
import sys

CLI_ONLY = ("config", "set", "list_models", "print_config")  # flags that are not recipe keys


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line on stderr (and exit code 2), as every other user
    error of the zoo's programs, instead of the usage block followed by the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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
    p.add_argument("--config", help="a YAML recipe file layered over configs/<model>.yaml (default: none)")
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


def list_models() -> str:
    """One line per registered model: name, parameters, forward FLOPs per 32x32 image, shipped weights."""
    from zoo.models import create_model, list_models, model_info, shipped_models

    lines = [f"{'model':16} {'params':>12} {'FLOPs/image':>14}  weights"]
    for name in list_models():
        info = model_info(create_model(name))
        shipped = "shipped" if name in shipped_models() else "-"
        lines.append(f"{name:16} {info['params']:>12,} {info['flops']:>14,}  {shipped}")
    return "\n".join(lines)


def line_buffered_output() -> None:
    """Each printed line goes out at once also when stdout is a pipe or a file (``| tee``, nohup, a SLURM log),
    where Python would otherwise hold it in a block buffer until the run ends."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and not stream.isatty():
            stream.reconfigure(line_buffering=True)


def parse_or_exit_code(parse, argv) -> argparse.Namespace | int:
    """``parse(argv)``, or the exit code argparse chose (2 for a bad command line, 0 for --help)."""
    try:
        return parse(argv)
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else 0


def _error(err: Exception, code: int = 2) -> int:
    print(f"train.py: error: {err}".splitlines()[0], file=sys.stderr)
    return code


def main(argv=None) -> int:
    from zoo.train.quiet import zoo_warnings_in_one_line

    line_buffered_output()
    zoo_warnings_in_one_line("train.py")
    args = parse_or_exit_code(lambda argv: build_parser().parse_args(argv), argv)
    if isinstance(args, int):
        return args
    if args.list_models:
        print(list_models())
        return 0
    from zoo.train.device import resolve_accelerator
    from zoo.train.loggers import require_loggers
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
        return _error(err)
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
        return _error(err)
    except NonFiniteLossError as err:
        return _error(err, 1)
    print(run_dir)
    return 0
