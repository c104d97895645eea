"""train.py's command line, derived from the option declarations (engine.config.options), and the argparse pieces every
command of the project shares (``OptionParser``, ``key_value``, ``yaml_scalar``; convbias.cli re-exports them), among
them the declared types of the other commands' options: ``Typed`` (a number, finite and within a declared
``Check`` such as train.py's options have, or a name a ``Check`` accepts) and ``DEVICE`` (a device of this machine),
so that every value is refused at parsing, before any work, in one line.

Light to import: ``train.py --help`` builds this parser and loads no torch.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import math
import typing
from typing import Any

import yaml

from convbias.base.devices import DEVICE_FORMS, check_device
from convbias.base.errors import ConfigError
from convbias.base.inputs import parse_yaml, quoted
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS

from .options import (
    DESCRIPTION,
    SECTIONS,
    Check,
    declaration,
    default_value,
    flag_name,
    option_aliases,
    option_names,
    option_types,
)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows every option's default (argparse's own formatter skips options without a help text)."""

    def _format_action(self, action: argparse.Action) -> str:
        shown = (
            action.option_strings
            and action.default not in (None, [], argparse.SUPPRESS)
            and "%(default)" not in (action.help or "")
            and (action.nargs != 0 or isinstance(action, argparse.BooleanOptionalAction))
        )
        if shown:
            action = copy.copy(action)
            action.help = f"{action.help or ''} (default: %(default)s)".strip()
        return super()._format_action(action)


class OptionParser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line) instead of printing usage and exiting."""

    def error(self, message: str) -> None:
        raise ConfigError(message)


def yaml_scalar(text: str) -> Any:
    """'4' -> 4, '0.1' -> 0.1, 'true' -> True, 'none'/'null' -> None, anything else stays a string."""
    if text.lower() == "none":
        return None
    try:
        value = parse_yaml(text)
    except yaml.YAMLError:  # not YAML, or beyond its limits (nested, aliases): the text as it is
        return text
    return text if isinstance(value, (dict, list)) else value


def non_finite(value: Any) -> float | None:
    """The first NaN or infinity in ``value`` (a number, or a list, tuple or mapping of them), else None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((found for found in map(non_finite, items) if found is not None), None)


def _finite_pair(text: str, key: str, value: Any) -> tuple[str, Any]:
    if non_finite(value) is not None:
        raise argparse.ArgumentTypeError(f"{quoted(text)}: the value must be a finite number, got {non_finite(value)}")
    return key, value


def key_value(text: str) -> tuple[str, Any]:
    """argparse type of every K=V option of the project's commands: 'k=0.1' -> ('k', 0.1) (YAML scalars); a NaN
    or infinity is refused (no model or optimizer argument takes one)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got '{text}'")
    return _finite_pair(text, key, yaml_scalar(value))


def literal_key_value(text: str) -> tuple[str, Any]:
    """argparse type of train.py's K=V options, as timm's train.py reads --model-kwargs (its ParseKwargs): the
    value a Python literal ('(32, 64)' -> a tuple), else a YAML scalar ('true' -> True), else the string."""
    key, value = key_value(text)
    try:
        return _finite_pair(text, key, ast.literal_eval(text.partition("=")[2]))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return key, value


class Typed:
    """argparse ``type`` of an option of a command, declared with its check as train.py's options are
    (engine.config.options): the text as ``kind`` (int, float or str), a number finite, then ``rule`` (a
    ``Check``: POSITIVE_INT, PROBABILITY, ...); argparse names the option in the one line that refuses it. What
    it takes stays readable (``kind``, ``rule``), so that a test derives the values it refuses."""

    def __init__(self, kind: type, rule: Check | None = None):
        self.kind, self.rule = kind, rule
        self.__name__ = kind.__name__  # argparse's name of the type in its own messages

    def __call__(self, text: str) -> Any:
        try:
            value = self.kind(text)
        except ValueError:
            expected = {int: "an integer", float: "a number"}.get(self.kind, self.kind.__name__)
            raise argparse.ArgumentTypeError(f"expected {expected}, got {quoted(text)!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if self.rule is not None and not self.rule.valid(value):
            reason = self.rule.reason(value) if self.rule.reason else f"must be {self.rule.expected}"
            raise argparse.ArgumentTypeError(f"{reason}, got {quoted(text)}")
        return value

    def __repr__(self) -> str:
        return f"Typed({self.__name__}{', ' + self.rule.expected if self.rule else ''})"


def declared(name: str) -> dict[str, Any]:
    """argparse's ``type`` (and ``choices``) of another command's option that is train.py's option ``name`` too
    (--img-size, --batch-size, --seed, ...): its declared type and check, so both commands take the same values."""
    kind = option_types()[name]
    kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
    kind = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
    argument: dict[str, Any] = {"type": Typed(kind, declaration(name).metadata["check"])}
    if declaration(name).metadata["choices"] is not None:
        argument["choices"] = declaration(name).metadata["choices"]
    return argument


class Device:
    """argparse ``type`` of ``--device``: cpu, cuda or cuda:N, a device of this machine (base.devices)."""

    __name__ = "device"

    def __call__(self, text: str) -> str:
        try:
            return check_device(text)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None


DEVICE = Device()


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """The ``--device`` of a command that runs models: checked against this machine as it is parsed; left None
    when not given (``base.devices.default_device``: cuda when there is one)."""
    parser.add_argument(
        "--device", type=DEVICE, metavar="DEVICE", help=f"{DEVICE_FORMS} (default: cuda when this machine has one)"
    )


def _argument(spec: dataclasses.Field, kind: Any) -> dict[str, Any]:
    """argparse's keyword arguments for one declared option, from its type and metadata."""
    meta = spec.metadata
    argument: dict[str, Any] = dict(
        default=default_value(spec.name), help=meta["help"] or None, metavar=meta["metavar"]
    )
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    origin = typing.get_origin(kind)
    if kind is bool and spec.name.startswith("no_"):  # --no-aug: a switch, not --no-no-aug
        argument.update(action="store_true")
    elif kind is bool:
        argument.update(action=argparse.BooleanOptionalAction)
    elif set(args) == {bool, str}:  # --eval-only [RUN_OR_WEIGHTS]
        argument.update(nargs="?", const=True)
    elif origin is dict:  # K=V pairs, merged with the recipe's mapping key by key
        argument.update(nargs="*", type=literal_key_value, default=None)
    elif origin is list or (args and typing.get_origin(args[0]) is list):
        item = typing.get_args(args[0] if origin is not list else kind)[0]
        argument.update(nargs=meta["nargs"] or "*", type=None if item is str else item)
    elif (args and args[0] is not str) or kind in (int, float):
        argument.update(type=args[0] if args else kind)
    return {key: value for key, value in argument.items() if value is not None or key == "default"}


# timm's train.py's short flags
SHORT_FLAGS = {"batch_size": "-b", "workers": "-j", "eval_batch_size": "-vb"}
# timm's train.py options whose value is optional or a list, among those this engine has no option of its own for
TIMM_OPTIONAL_VALUE = {"torchcompile": "inductor"}
TIMM_LISTS = ("device_modules", "train_img_sizes", "train_batch_sizes", "train_size_probs")
TIMM_GROUP = "timm's train.py options (translated to the options above, or refused with the reason)"


def _timm_argument(name: str, default: Any) -> dict[str, Any]:
    """argparse's keyword arguments for a timm train.py option this engine reads as timm's args.yaml key
    (engine.config.timm_args): only a given one is parsed (SUPPRESS), its value typed as timm's parser types it."""
    argument: dict[str, Any] = dict(default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    if isinstance(default, bool):
        argument.update(action="store_const", const=not default)
    elif name in TIMM_OPTIONAL_VALUE:
        argument.update(nargs="?", const=TIMM_OPTIONAL_VALUE[name], type=yaml_scalar)
    elif isinstance(default, list) or name in TIMM_LISTS:
        argument.update(nargs="+", type=yaml_scalar)
    else:
        argument.update(type=yaml_scalar)
    return argument


def timm_only_options() -> dict[str, Any]:
    """timm's train.py options (their args.yaml keys and defaults) that are neither an option here nor an alias."""
    return {k: v for k, v in TIMM_TRAIN_DEFAULTS.items() if k not in option_names() and k not in option_aliases()}


def build_parser() -> argparse.ArgumentParser:
    """train.py's parser, one argument per declared option, grouped by section, with timm's short flags; timm's
    other options are parsed too (engine.config.timm_args translates or refuses them). Unique prefixes of a flag are
    accepted, as by timm's parser (argparse's allow_abbrev)."""
    parser = OptionParser(
        prog="train.py", description=DESCRIPTION, allow_abbrev=True, formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("-c", "--config", **_argument(declaration("config"), option_types()["config"]))
    for title, section in SECTIONS:
        group = parser.add_argument_group(title)
        for spec in dataclasses.fields(section):
            flags = [flag_name(name) for name in (spec.name, *spec.metadata["aliases"])]
            flags += [SHORT_FLAGS[spec.name]] if spec.name in SHORT_FLAGS else []
            group.add_argument(*flags, **_argument(spec, option_types()[spec.name]))
    group = parser.add_argument_group(TIMM_GROUP)
    group.add_argument(  # timm's train.py DIR (deprecated there for --data-dir, still taken)
        "data", nargs="?", metavar="DIR", default=argparse.SUPPRESS, help="the data folder, as --data-dir (timm's)"
    )
    for name, default in timm_only_options().items():
        flags = [flag_name(name)] + (["--train-steps-per-epoch"] if name == "train_batches_per_epoch" else [])
        group.add_argument(*flags, dest=name, **_timm_argument(name, default))
    return parser
