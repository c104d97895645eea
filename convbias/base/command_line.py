"""The argparse pieces every command of the project shares, none of them tied to the engine: ``OptionParser``
(a refusal is one ConfigError line), ``DefaultsHelpFormatter``, the K=V and scalar types (``key_value``,
``literal_key_value``, ``yaml_scalar``, ``non_finite``), ``Typed`` (a number, finite and within a rule such as
the engine's declared ``Check``, or a name a rule accepts) and ``DEVICE`` / ``add_device_option`` (a device of
this machine), so that every value is refused at parsing, before any work, in one line.

train.py's parser, built from the engine's declarations, and ``declared`` (another command's option that is
train.py's too) are the engine's (``convbias.engine.build_parser``, ``convbias.engine.declared``).

Light to import: ``train.py --help`` builds its parser from these and loads no torch.
"""

from __future__ import annotations

import argparse
import ast
import copy
import math
from collections.abc import Callable
from typing import Any, Protocol

import yaml

from .devices import DEVICE_FORMS, check_device
from .errors import ConfigError
from .inputs import parse_yaml, quoted


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


class Rule(Protocol):
    """What ``Typed`` checks a value against: ``valid(value)``, else ``must be {expected}`` or, with ``reason``,
    ``reason(value)``. The engine's declared ``Check`` (POSITIVE_INT, PROBABILITY, ...) is one."""

    @property
    def valid(self) -> Callable[[Any], bool]: ...

    @property
    def expected(self) -> str: ...

    @property
    def reason(self) -> Callable[[Any], str] | None: ...


class Typed:
    """argparse ``type`` of an option of a command, declared with its check as train.py's options are
    (engine.config.options): the text as ``kind`` (int, float or str), a number finite, then ``rule`` (a
    ``Rule``: the engine's POSITIVE_INT, PROBABILITY, ...); argparse names the option in the one line that
    refuses it. What it takes stays readable (``kind``, ``rule``), so that a test derives the values it refuses."""

    def __init__(self, kind: type, rule: Rule | None = None):
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
