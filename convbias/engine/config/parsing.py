"""Run configuration: the command line (options in ``engine.config.options``) over YAML recipes (``-c``), validated.

The option names follow timm's ``train.py``. A YAML key is the option name with ``_`` instead of ``-``
(``batch_size: 64``). Precedence: built-in defaults (timm's train.py's) < YAML file(s) < command line; the
DeiT recipe is a file (configs/recipes/deit.yaml).
A YAML file may name other files under ``_base_`` (a path or a list of paths relative to itself); they are
loaded first and the file's own keys override them.

Everything here runs before any work starts: a user mistake raises ``ConfigError`` with a one-line
message naming the option and the expected form; train.py (``convbias.cli.train``) prints it as ``error: ...``
and exits 2.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import signal
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, NamedTuple

from convbias.base.errors import ConfigError
from convbias.base.inputs import quoted, read_yaml
from convbias.base.run_layout import CONFIG_FILE, TIMM_ARGS_FILE
from convbias.engine.config.timm_train_options import TIMM_TRAIN_DEFAULTS

from .command_line import OptionParser, build_parser, non_finite, timm_only_options
from .derived import effective_epochs
from .options import (
    IMAGE_MODE_CHANNELS,
    Check,
    Config,
    declaration,
    default_value,
    did_you_mean,
    flag_name,
    key_value_options,
    option_names,
    option_types,
)
from .timm_args import ignored_timm_keys, is_timm_args, translate_timm_keys


def load_yaml(
    path: str | Path,
    origins: dict[str, str] | None = None,
    _including: tuple[Path, ...] = (),
    places: dict[str, str] | None = None,
) -> dict:
    """Read a recipe, following ``_base_`` files first (relative to the file that names them); ``origins``, when
    given, gets the name of the file that set each key, and ``places`` where it is set ('recipe PATH, line N:
    key', how a message names a value of the file). A file that names itself, directly or through its bases, is
    refused naming the cycle; a key given twice in one file, naming both lines (base.inputs)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    real = path.resolve()
    if real in _including:
        cycle = " -> ".join(str(p) for p in (*_including[_including.index(real) :], real))
        raise ConfigError(f"{path}: the _base_ files name each other in a cycle ({cycle})")
    lines: dict[Any, int] = {}
    data = read_yaml(path, "recipe", key_lines=lines) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of option: value")
    bases = data.pop("_base_", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(base, str) for base in bases):
        raise ConfigError(f"{path}: _base_ must be a path or a list of paths, got {quoted(bases)}")
    merged: dict = {}
    for base in bases:
        merged.update(load_yaml(path.parent / base, origins, (*_including, real), places))
    merged.update(data)
    if origins is not None:
        origins.update(dict.fromkeys(data, f"recipe {path.name}"))
    if places is not None:
        places.update({key: file_place("recipe", path, lines.get(key), key) for key in data})
    return merged


def _evaluated(known: argparse.Namespace) -> str | None:
    """What --eval-only RUN_OR_WEIGHTS (or --eval-only --checkpoint RUN_OR_WEIGHTS) names, if given."""
    return known.eval_only if isinstance(known.eval_only, str) else known.checkpoint if known.eval_only else None


def _evaluated_source(target: str) -> str:
    """Where the options that --eval-only takes from ``target`` come from: a run's config.yaml, timm's output
    folder's args.yaml, else the args saved in timm's checkpoint."""
    path = Path(target)
    if (path / CONFIG_FILE).is_file():
        return f"the evaluated run's {CONFIG_FILE}"
    if (path / TIMM_ARGS_FILE).is_file():
        return f"the evaluated folder's {TIMM_ARGS_FILE}"
    return "the evaluated checkpoint's saved args"


def _as_dict(value: Any, key: str) -> dict:
    """KEY=VALUE options arrive as a list of pairs (command line) or a mapping (YAML)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list) and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        return dict(value)
    raise ConfigError(f"{key} must be a mapping (YAML) or KEY=VALUE pairs, got {value!r}")


def parse_config(
    argv: list[str] | None,
    evaluated_run: Callable[[str], dict] | None = None,
    package_problems: Callable[[Config], list[str]] | None = None,
) -> Config:
    """Parse argv (with its ``-c`` recipe) into a Config that passes this package's checks (``validate``) and the
    other packages' (``package_problems``: the entry point's, ``convbias.engine.parse_config``). ``evaluated_run``
    gives the options that --eval-only RUN_DIR takes from the run directory it names ({} for weights): they rank
    below the -c recipe and the command line. Raises one ConfigError naming every refused option and key (the
    command line's and its files') with its reason."""
    parser = build_parser()
    config_only = OptionParser(add_help=False)
    config_only.add_argument("-c", "--config", default=None)
    config_only.add_argument("--eval-only", nargs="?", const=True, default=False)
    config_only.add_argument("--checkpoint", "--initial-checkpoint", default=None)
    known, _ = config_only.parse_known_args(argv)
    origins: dict[str, str] = {}
    places: dict[str, str] = {}  # where each value of a file is set, as its messages name it
    file_cfg = load_yaml(known.config, origins, places=places) if known.config else {}
    experiment = file_cfg.get("experiment") if is_timm_args(file_cfg) else None
    problems: list[str] = []
    ignored = ignored_timm_keys(file_cfg) if is_timm_args(file_cfg) else []  # taken and never read by timm
    if is_timm_args(file_cfg):  # the args.yaml of timm's train.py
        file_cfg, file_problems = translate_timm_keys(file_cfg, known.config)
        problems += [f"{known.config}: {problem}" for problem in file_problems]
        origins.update({key: f"recipe {Path(known.config).name}" for key in file_cfg if key not in origins})
    target = _evaluated(known)
    run_options = evaluated_run(target) if evaluated_run is not None and target is not None else {}
    if run_options:
        source = _evaluated_source(target)
        origins.update({key: source for key in run_options if key not in file_cfg})
    # a run's config.yaml is checked, naming it, as it is read; timm's args (args.yaml, a checkpoint's) are named here
    places.update({key: f"{target}: {key}" for key in run_options if key not in file_cfg})
    file_cfg = {**run_options, **file_cfg}
    for key in [key for key in file_cfg if key not in option_names()]:
        problems.append(f"{places.get(key, f'{known.config}: {key}')}: unknown option{did_you_mean(key)}")
        del file_cfg[key]
    problems += _typed_file_values(parser, file_cfg, places)
    merged = key_value_options()
    parser.set_defaults(**{k: v for k, v in file_cfg.items() if k not in merged})
    namespace, extra = parser.parse_known_args(argv)
    args = vars(namespace)
    problems += [
        f"{item}: unknown option{did_you_mean(item.lstrip('-').replace('-', '_'))}"
        if item.startswith("-")
        else f"unexpected argument '{item}'"
        for item in extra
    ]
    timm_given = {name: args.pop(name) for name in timm_only_options() if name in args}
    set_by_timm_names: set[str] = set()  # options that timm's names on the command line set
    if timm_given:  # timm's train.py options given on the command line: as its args.yaml keys
        for name, shared in (("experiment", "output"), ("drop_connect", "drop_path"), ("data", "data_dir")):
            if name in timm_given:
                timm_given[shared] = args[shared]
        translated, timm_problems = translate_timm_keys(timm_given, "the command line")
        problems += [f"{flag_name(p.split(':')[0])}{p[len(p.split(':')[0]) :]}" for p in timm_problems]
        set_by_timm_names = {name for name, value in translated.items() if args.get(name) != value}
        args.update(translated)
    for key in merged:  # merged key by key: the command line wins per key; given with no pairs, it clears (timm)
        value = args[key]
        args[key] = {} if value == [] else {**_as_dict(file_cfg.get(key), key), **_as_dict(value, flag_name(key))}
    given = _given_on_command_line(argv)
    command_line = {*given, *set_by_timm_names}
    if experiment and "output" in command_line and "experiment" not in timm_given:
        args["output"] = str(Path(args["output"]) / experiment)  # timm writes into OUTPUT/EXPERIMENT
    cfg = Config(**args)
    sources = {name: "command line" if name in command_line else origins[name] for name in {*file_cfg, *command_line}}
    for name in merged:  # each key of a KEY=VALUE option: the command line's, else the recipe's
        for key in _as_dict(file_cfg.get(name), name):
            sources[f"{name}.{key}"] = origins[name]
        for key in _as_dict(given.get(name) or None, flag_name(name)):
            sources[f"{name}.{key}"] = "command line"
    cfg.__dict__[SOURCES] = sources
    cfg.__dict__[IGNORED_KEYS] = (known.config, ignored)
    cfg.__dict__[PLACES] = {name: place for name, place in places.items() if name not in command_line}
    try:
        validate(cfg)
    except ConfigError as e:
        problems.append(str(e))
    else:
        problems += package_problems(cfg) if package_problems is not None else []
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


# A parsed Config's record of where each option set by the user came from (the start-up block prints it)
SOURCES = "_option_sources"
# ... and of the -c file's keys that timm's train.py would ignore, ignored here too: (the file, the keys)
IGNORED_KEYS = "_ignored_keys"
# ... and of the options that the checks or the run's set-up derived from others: option -> what gave its value
DERIVED = "_derived_sources"
# ... and, for an option a file set, where in the file: how a refusal of its value names it
PLACES = "_option_places"


def credit(cfg: Config, name: str, source: str) -> None:
    """Record that option ``name``'s value was derived from ``source`` (another option, the model's config), which
    ``option_source`` then names, whether ``cfg`` was parsed or built in Python."""
    cfg.__dict__.setdefault(DERIVED, {})[name] = source


def _typed_file_values(parser: argparse.ArgumentParser, values: dict[str, Any], places: dict[str, str]) -> list[str]:
    """A file's text values typed as the command line's are (argparse types the defaults it is given, and would
    name a bad one as the command line's ``argument --lr``), in place; a value that does not convert is dropped
    and named by its file, line and key."""
    types = _parser_types(parser)
    problems = []
    for key, value in list(values.items()):
        try:
            values[key] = _typed_text(types, key, value, places.get(key, key))
        except ConfigError as e:
            problems.append(str(e))
            del values[key]
    return problems


def _parser_types(parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {action.dest: action.type for action in parser._actions if action.type is not None}


def _typed_text(types: dict[str, Any], name: str, value: Any, label: str) -> Any:
    """A file's text value of option ``name`` typed by its command-line type (``value`` when it is no text)."""
    kind = types.get(name)
    if not isinstance(value, str) or kind is None or name in key_value_options():
        return value
    try:
        return kind(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise ConfigError(f"{label} expects {_describe(kind, None)}, got {quoted(repr(value))}") from None


def file_option_value(name: str, value: Any, label: str, parser: argparse.ArgumentParser | None = None) -> Any:
    """A value of train.py's option ``name`` that a file gives (a sweep file's ``set``, ``grid`` or
    ``variants``), typed and checked as a recipe's is; a ConfigError naming ``label`` (the file, line and key)."""
    value = _typed_text(_parser_types(parser or build_parser()), name, value, label)
    value = coerce(name, value, label)
    check_option(name, value, label)
    return value


def option_label(cfg: Config, name: str) -> str:
    """How a message names option ``name`` of ``cfg``: where a file set it (its path, line and key), else its flag."""
    return (cfg.__dict__.get(PLACES) or {}).get(name) or flag_name(name)


def _given_on_command_line(argv: list[str] | None) -> dict[str, Any]:
    """The options the command line names, with their values (argparse with no defaults: only the given ones are
    parsed)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return vars(parser.parse_known_args(argv)[0])


def option_source(cfg: Config, name: str) -> str:
    """Where option ``name``'s value came from: the command line, a recipe file, or the default (timm's train.py's
    where timm has the option); a Config built in Python: 'set' where it differs from the default."""
    derived, sources = cfg.__dict__.get(DERIVED) or {}, cfg.__dict__.get(SOURCES)
    if name in derived:
        return derived[name]
    if sources is not None and name in sources:
        return sources[name]
    if sources is None and getattr(cfg, name) != default_value(name):
        return "set"
    return "timm default" if name in TIMM_TRAIN_DEFAULTS else "default"


def key_source(cfg: Config, name: str, key: str) -> str:
    """Where ``key`` of the KEY=VALUE option ``name`` (--model-kwargs) came from: the command line or a recipe
    file (each key of the option is merged from both, the command line's winning)."""
    return (cfg.__dict__.get(SOURCES) or {}).get(f"{name}.{key}") or option_source(cfg, name)


def require(condition: bool, message: str) -> None:
    """A ConfigError with ``message`` unless ``condition``: how every package's check states a rule."""
    if not condition:
        raise ConfigError(message)


def _describe(kind: Any, nargs: int | str | None) -> str:
    """How an error names a declared type: 'float', 'a string', 'a list of 2 float values'."""
    if kind is str:
        return "a string"
    if typing.get_origin(kind) is list:
        count = f"{nargs} " if isinstance(nargs, int) else ""
        return f"a list of {count}{typing.get_args(kind)[0].__name__} values"
    if typing.get_origin(kind) is dict:
        return "a mapping (YAML) or KEY=VALUE pairs"
    return getattr(kind, "__name__", str(kind))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def coerce(name: str, value: Any, label: str | None = None) -> Any:
    """``value`` as option ``name``'s declared type (a recipe's values skip argparse's conversion; ``as_type``),
    a ConfigError naming the option (or ``label``: the file and key it came from) otherwise."""
    return as_type(option_types()[name], value, label or flag_name(name), declaration(name).metadata["nargs"])


def as_type(kind: Any, value: Any, label: str, nargs: int | str | None = None) -> Any:
    """``value`` as the declared type ``kind`` (a type hint: float, list[int], dict[str, Any], int | None, ...):
    ints to floats, a string of items to a list, K=V pairs to a mapping; a ConfigError naming ``label``
    otherwise. inf and nan make no sense for any declared number."""
    candidates = (
        [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) in (typing.Union, types.UnionType)
        else [kind]
    )
    if value is None and len(candidates) < len(typing.get_args(kind) or (kind,)):
        return None
    for candidate in candidates:
        converted = _converted(value, candidate, nargs)
        if converted is not _INVALID:
            bad = non_finite(converted)
            require(bad is None, f"{label} must be a finite number, got {bad}")
            return converted
    raise ConfigError(
        f"{label} expects {_describe(candidates[0], nargs)}, got {quoted(repr(value) if isinstance(value, str) else value)}"
    )


_INVALID = object()


def _converted(value: Any, kind: Any, nargs: int | str | None) -> Any:
    """``value`` converted to ``kind``, or _INVALID."""
    origin = typing.get_origin(kind)
    if kind is Any:
        return value
    if kind is float:
        return float(value) if _is_number(value) else _INVALID
    if kind is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _INVALID
    if kind in (bool, str):
        return value if isinstance(value, kind) else _INVALID
    if origin is dict:
        if isinstance(value, dict):
            return dict(value)
        pairs = isinstance(value, list) and all(isinstance(v, tuple) and len(v) == 2 for v in value)
        return dict(value) if pairs else _INVALID
    if origin is list:
        item = typing.get_args(kind)[0]
        if isinstance(value, str) and item is str:  # a recipe's string of space-separated items
            value = value.split()
        if not isinstance(value, (list, tuple)) or (isinstance(nargs, int) and len(value) != nargs):
            return _INVALID
        items = [_converted(v, item, None) for v in value]
        return _INVALID if _INVALID in items else items
    return _INVALID


def check_option(name: str, value: Any, label: str | None = None) -> None:
    """ConfigError naming the option (or ``label``) when ``value`` breaks its declared check or choices."""
    meta = declaration(name).metadata
    check_value(value, label or flag_name(name), meta["check"], meta["choices"])


def check_value(value: Any, label: str, rule: Check | None, choices: Sequence[Any] | None = None) -> None:
    """ConfigError naming ``label`` (a flag, or a file and key) when ``value`` is not one of ``choices`` or breaks
    ``rule``; None passes (an option left unset)."""
    if value is None:
        return
    if choices is not None:
        unknown = f"unknown {label} '{value}'" if label.startswith("-") else f"{label}: unknown value '{value}'"
        shown = ", ".join(repr(c) if c == "" else str(c) for c in choices)
        require(value in choices, f"{unknown}; choices: {shown}")
    if rule is not None and not rule.valid(value):
        shown = f"{label} {quoted(value)}" if label.startswith("-") else f"{label}: {quoted(value)}"
        raise ConfigError(
            f"{shown}: {rule.reason(value)}" if rule.reason else f"{label} must be {rule.expected}, got {quoted(value)}"
        )


class Declared(NamedTuple):
    """One key of a command's own YAML file (a study's config): its type (a type hint), and its check and choices
    as a train.py option's (engine.config.options)."""

    kind: Any
    check: Check | None = None
    choices: tuple[Any, ...] | None = None


def train_option(name: str) -> Declared:
    """The declaration of a file key that is train.py's option ``name`` too (seed, batch_size, ...): one rule."""
    meta = declaration(name).metadata
    return Declared(option_types()[name], meta["check"], meta["choices"])


def dataclass_declarations(cls: type) -> dict[str, Declared]:
    """The declarations of a dataclass's fields: each field's type hint, and the check of its ``metadata``."""
    hints = typing.get_type_hints(cls)
    return {f.name: Declared(hints[f.name], f.metadata.get("check"), f.metadata.get("choices")) for f in fields(cls)}


def declared_value(spec: Declared, value: Any, label: str) -> Any:
    """``value`` as ``spec`` declares it (its type, then its check and choices); a ConfigError naming ``label``."""
    converted = as_type(spec.kind, value, label)
    check_value(converted, label, spec.check, spec.choices)
    return converted


def file_place(what: str, path: str | Path, line: int | None, key: str) -> str:
    """How a message names the value of ``key`` in a file: 'recipe PATH, line N: key'."""
    return f"{what} {path}, line {line}: {key}" if line is not None else f"{what} {path}: {key}"


def read_declared_yaml(
    path: str | Path,
    what: str,
    declared: Mapping[str, Declared],
    error: type[Exception] = ConfigError,
    plain: bool = False,
) -> dict[str, Any]:
    """The mapping of the YAML file ``path`` (a ``what``: 'protocol config'), every key one of ``declared`` and
    its value converted and checked as declared (``declared_value``); ``error`` naming the file, the line and the
    key of the first that is not (a key given twice, naming both lines: base.inputs). With ``plain``: a file the
    package wrote and reads back (``inputs.check_plain_file``)."""
    lines: dict[Any, int] = {}
    data = read_yaml(path, what, error, plain=plain, key_lines=lines)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise error(f"{what} {path} must hold a mapping of key: value")
    values = {}
    for key, value in data.items():
        label = file_place(what, path, lines.get(str(key)), str(key))
        if key not in declared:
            close = difflib.get_close_matches(str(key), declared, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise error(f"{label}: unknown key{hint}; known: {', '.join(declared)}")
        try:
            values[key] = declared_value(declared[key], value, label)
        except ConfigError as e:
            raise error(str(e)) from None
    return values


def inert_options(cfg: Config) -> dict[str, str]:
    """The options that act only with others (their declared `needs`), set without them: each with its
    '--name VALUE has no effect without ...'."""
    found = {}
    for name in option_names():
        needs, value = declaration(name).metadata["needs"], getattr(cfg, name)
        if needs is not None and value != default_value(name) and not needs.met(cfg):
            given = flag_name(name) if value is True else f"{flag_name(name)} {value}"
            found[name] = f"{given} has no effect without {needs.what}"
    return found


def config_warnings(cfg: Config, trained_epochs: int | None = None) -> list[str]:
    """Valid but probably unintended settings, printed as `warning: ...` lines before the run starts: among them
    timm's options set where they have no effect, which timm's train.py ignores and so does this engine.
    ``trained_epochs``: the epochs the run trains as timm's scheduler counts them (engine.optim.factory's
    trained_epochs: the schedule's and a cooldown, further lr cycles), by default the schedule's."""
    warnings = [
        f"{message}: ignored, as timm's train.py ignores it"
        for name, message in inert_options(cfg).items()
        if name in TIMM_TRAIN_DEFAULTS
    ]
    source, ignored = cfg.__dict__.get(IGNORED_KEYS) or (None, [])
    if ignored:
        warnings.append(
            f"{source}: {len(ignored)} key{'s' if len(ignored) > 1 else ''} that no option reads (a fork's own, or "
            f"attributes timm's train.py sets at run time): {', '.join(ignored)}; ignored, as timm's train.py ignores "
            "them"
        )
    epochs, warmup = effective_epochs(cfg)
    trained = trained_epochs or epochs
    if not cfg.eval_only and not cfg.warmup_prefix and warmup >= epochs:
        covered = (
            f"the whole run of {epochs} epoch(s)"
            if trained == epochs
            else f"the whole schedule of {epochs} epoch(s) of the {trained} the run trains (--cooldown-epochs, lr "
            "cycles: at the schedule's end lr)"
        )
        warnings.append(
            f"--warmup-epochs {warmup} covers {covered}: the lr only ramps up from --warmup-lr and never reaches its "
            "peak; lower --warmup-epochs"
        )
    return warnings


def validate(cfg: Config) -> None:
    """This package's checks, which need no other package: types, ranges, combinations of options, names,
    paths; the options normalized and their defaults derived on the way (cfg is changed in place). A Config built
    in Python goes through the same checks as one parsed from a command line; the packages that own the other
    rules (data sources, timm's optimizers, torch.compile's backends, the run directory) check them after this,
    called by the entry point (``convbias.engine.validate``). Raises ConfigError."""
    _normalize_eval_only(cfg)
    problems = []
    for name in option_names():  # each option's own type and range, all named at once
        try:
            setattr(cfg, name, coerce(name, getattr(cfg, name), option_label(cfg, name)))
            check_option(name, getattr(cfg, name), option_label(cfg, name))
        except ConfigError as e:
            problems.append(str(e))
    require(not problems, "; ".join(problems))
    require(isinstance(cfg.model, str), "no model given: pass --model NAME (or 'model:' in the -c recipe)")
    require(cfg.epochs >= 1 or cfg.eval_only, f"--epochs must be a positive integer, got {cfg.epochs}")
    _normalize(cfg)
    _check_combinations(cfg)
    _check_names(cfg)
    _check_paths(cfg)
    if cfg.output is None:
        cfg.output = str(Path("runs") / f"{cfg.model}-{cfg.dataset}")


def _normalize_eval_only(cfg: Config) -> None:
    """--eval-only RUN_OR_WEIGHTS is --eval-only --checkpoint RUN_OR_WEIGHTS."""
    if isinstance(cfg.eval_only, str):
        require(
            cfg.checkpoint in (None, cfg.eval_only),
            f"--eval-only {cfg.eval_only} and --checkpoint {cfg.checkpoint} name different weights; give one",
        )
        cfg.checkpoint, cfg.eval_only = cfg.eval_only, True


def _normalize(cfg: Config) -> None:
    """One switch for every augmentation (so the data layer and the loss agree), 'none' spellings, and the
    options that imply others."""
    if cfg.dataset == "":  # timm's default: the image folder at --data-dir
        cfg.dataset = "folder"
    if cfg.no_aug:
        cfg.aa, cfg.reprob, cfg.color_jitter, cfg.hflip = None, 0.0, 0.0, 0.0
        cfg.mixup, cfg.cutmix, cfg.smoothing = 0.0, 0.0, 0.0
        sources = cfg.__dict__.get(SOURCES)
        if sources is not None:  # the values are --no-aug's, wherever it was given
            by = f"--no-aug ({option_source(cfg, 'no_aug')})"
            sources.update(dict.fromkeys(("aa", "reprob", "color_jitter", "hflip", "mixup", "cutmix", "smoothing"), by))
    if isinstance(cfg.aa, str) and cfg.aa.lower() in ("none", ""):
        cfg.aa = None
    if [s.lower() for s in cfg.preempt_signals] == ["none"]:
        cfg.preempt_signals = []
    if cfg.pretrained_file:
        cfg.pretrained = True
    if cfg.input_size is not None:  # timm's --input-size C H W: --in-chans C --img-size H (_check_input: they agree)
        given = option_source(cfg, "input_size") == "command line"
        for name, value in (("in_chans", cfg.input_size[0]), ("img_size", cfg.input_size[1])):
            # the command line's over a file's, as timm's resolve_data_config takes input_size over img_size
            if getattr(cfg, name) is None or (given and option_source(cfg, name) != "command line"):
                setattr(cfg, name, value)
                credit(cfg, name, f"--input-size ({option_source(cfg, 'input_size')})")
    if cfg.input_img_mode is not None:  # timm's image mode: the channels (_check_input: they agree)
        cfg.in_chans = cfg.in_chans or IMAGE_MODE_CHANNELS[cfg.input_img_mode]


def _check_input(cfg: Config) -> None:
    """--input-size and --input-img-mode against --img-size and --in-chans (the data package checks --mean/--std
    and --class-map, as it resolves them)."""
    if cfg.input_size is not None:
        given = f"--input-size {' '.join(map(str, cfg.input_size))}"
        for name, value in (("img_size", cfg.input_size[1]), ("in_chans", cfg.input_size[0])):
            require(
                getattr(cfg, name) == value,
                f"{given} and {flag_name(name)} {getattr(cfg, name)} disagree; give one of them",
            )
    mode = cfg.input_img_mode
    require(
        mode is None or cfg.in_chans == IMAGE_MODE_CHANNELS[mode],
        f"--input-img-mode {mode} and --in-chans {cfg.in_chans} disagree; give one of them",
    )


def _check_combinations(cfg: Config) -> None:
    """Rules that tie options together."""
    _check_input(cfg)
    require(
        cfg.output_scale is None or not (cfg.reparametrize or cfg.distill_teacher),
        "--output-scale cannot be combined with --reparametrize or hard distillation",
    )
    require(
        cfg.wandb_resume_id is None or bool(cfg.resume),
        f"--wandb-resume-id {cfg.wandb_resume_id} continues a wandb run, so it needs --resume (auto or a point)",
    )
    mixing = cfg.mixup > 0 or cfg.cutmix > 0 or cfg.cutmix_minmax is not None
    require(not mixing or cfg.batch_size % 2 == 0, f"mixup/cutmix need an even --batch-size, got {cfg.batch_size}")
    require(
        cfg.cutmix_minmax is None or not cfg.no_aug,
        "--cutmix-minmax turns cutmix on and --no-aug turns it off; drop one",
    )
    for name, message in inert_options(cfg).items():  # timm's own are ignored, as timm does (config_warnings)
        require(name in TIMM_TRAIN_DEFAULTS, message)
    require(not cfg.eval_only or cfg.checkpoint, "--eval-only needs --checkpoint PATH (a weights file or run dir)")
    require(
        bool(cfg.distill_teacher) == bool(cfg.distill_teacher_file),
        "hard distillation needs both --distill-teacher NAME and --distill-teacher-file PATH",
    )


def parse_signals(names: Sequence[str]) -> list[signal.Signals]:
    """--preempt-signals: 'SIGTERM', 'TERM' or '15' -> signal.SIGTERM; ConfigError naming the option for anything
    else."""
    parsed = []
    for name in names:
        text = str(name).upper()
        try:
            parsed.append(
                signal.Signals(int(text))
                if text.isdigit()
                else signal.Signals[text if text.startswith("SIG") else "SIG" + text]
            )
        except (KeyError, ValueError):
            raise ConfigError(
                f"--preempt-signals: unknown signal {name!r}; expected names such as SIGTERM SIGUSR1 "
                f"(or none to disable)"
            ) from None
        require(
            parsed[-1] not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT),
            f"--preempt-signals: {parsed[-1].name} cannot be used (it cannot be caught, or is Ctrl-C)",
        )
    return parsed


def _check_names(cfg: Config) -> None:
    """Names given as option values: signals, lr patterns (the optimizer's and the compile backend's are checked
    by the packages that use them)."""
    parse_signals(cfg.preempt_signals)
    for pattern, lr in cfg.param_group_lr.items():
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"--param-group-lr: '{pattern}' is not a regular expression ({e})") from None
        require(
            _is_number(lr) and 0 < lr < math.inf,
            f"--param-group-lr {pattern}=... needs a positive number, got {lr!r}",
        )


def _check_paths(cfg: Config) -> None:
    """Files the options name exist (data_dir: engine.data.factory names the expected layout)."""
    for name in ("pretrained_file", "checkpoint", "distill_teacher_file"):
        path = getattr(cfg, name)
        require(path is None or Path(path).exists(), f"{flag_name(name)}: path does not exist: {path}")
