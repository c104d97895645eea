"""train.py's command line, derived from the option declarations (engine.config.options), and ``declared``: the
argparse type (and choices) of another command's option that is train.py's option too. The argparse pieces every
command shares (``OptionParser``, ``Typed``, ``key_value``, ``yaml_scalar``, ``DEVICE``) are the bottom layer's
(``convbias.base.command_line``); ``OptionParser`` and ``non_finite`` are named here too, for the config package.

Light to import: ``train.py --help`` builds this parser and loads no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from convbias.base.command_line import (
    DefaultsHelpFormatter,
    OptionParser,
    Typed,
    literal_key_value,
    yaml_scalar,
)
from convbias.base.command_line import non_finite as non_finite  # the config package's, named here
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS

from .options import (
    DESCRIPTION,
    SECTIONS,
    declaration,
    default_value,
    flag_name,
    option_aliases,
    option_names,
    option_types,
)


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
