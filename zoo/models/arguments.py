"""A model's keyword arguments, read from its constructor: the entry point's own parameters, then those of the
class it returns (its annotation) and of the base classes that class forwards ``**kwargs`` to (timm's
``ResNet`` for ``CifarResNet``). ``check_arguments`` compares given arguments with them before the model is
built: an unknown name -> the valid names and the closest one, a value of the wrong type -> the annotated type
(ints are not bools, a float takes an int, a tuple a list of the right items; types it cannot judge, such as
layer classes, pass). The model's constructor checks ranges itself."""

from __future__ import annotations

import difflib
import inspect
import numbers
import types
import typing
from collections.abc import Callable, Mapping

from torch import nn

_SKIPPED = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def constructor_parameters(builder: Callable) -> dict[str, typing.Any]:
    """{name: type hint (``typing.Any`` where none can be read)} of every keyword a model entry point takes."""
    targets = [builder]
    built = _hints(builder).get("return")
    if isinstance(built, type):
        for cls in built.__mro__:
            if cls in (nn.Module, object) or "__init__" not in vars(cls):
                continue
            targets.append(cls.__init__)
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters
                       .values()):
                break
    parameters: dict[str, typing.Any] = {}
    for target in targets:
        hints = _hints(target)
        for p in inspect.signature(target).parameters.values():
            if p.name != "self" and p.kind not in _SKIPPED:
                parameters.setdefault(p.name, hints.get(p.name, typing.Any))
    return parameters


def check_arguments(model: str, builder: Callable, arguments: Mapping, *, prefix: str = "",
                    unknown_ok: bool = False) -> None:
    """ValueError naming the first argument ``model``'s constructor does not take (unless ``unknown_ok``: timm's
    ``build_model_with_cfg`` takes more, e.g. ``features_only``) or whose value is not of the annotated type;
    ``prefix`` goes before the names in the message (``model_args.``)."""
    parameters = constructor_parameters(builder)
    for name, value in arguments.items():
        if name not in parameters:
            if unknown_ok:
                continue
            close = difflib.get_close_matches(str(name), list(parameters), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ValueError(f"{model} takes no argument {prefix}{name}{hint}; valid: "
                             f"{', '.join(sorted(parameters))}")
        hint = parameters[name]
        if not _matches(value, hint):
            raise ValueError(f"{prefix}{name} of {model} must be {_describe(hint)}, got {value!r}")


def _hints(fn: Callable) -> dict:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # an annotation naming what its module does not import: that function goes unchecked
        return {}


def _matches(value, hint) -> bool:
    """Whether ``value`` fits ``hint``; True for what it cannot judge (Any, Callable, classes of layers)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is tuple:
        if not isinstance(value, (tuple, list)):  # YAML has no tuples: a list stands for one
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return not args or len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args, strict=True))
    if origin is not None:
        return not isinstance(origin, type) or isinstance(value, origin)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint in (str, tuple, list, dict):
        return isinstance(value, hint)
    return True


def _describe(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if isinstance(hint, type) and typing.get_origin(hint) is None:
        return hint.__name__
    return str(hint).replace("typing.", "")
