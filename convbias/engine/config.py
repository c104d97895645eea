"""Run configuration: the command line (options in ``engine.options``) over YAML recipes (``-c``), validated.

The option names follow timm's ``train.py``. A YAML key is the option name with ``_`` instead of ``-``
(``batch_size: 64``). Precedence: built-in defaults (the DeiT recipe) < YAML file(s) < command line.
A YAML file may name other files under ``_base_`` (a path or a list of paths relative to itself); they are
loaded first and the file's own keys override them.

Everything here runs before any work starts: a user mistake raises ``ConfigError`` with a one-line
message naming the option and the expected form; ``engine.main`` prints it as ``error: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

from ..storage import write_text
from .compile import COMPILE_MODES
from .errors import ConfigError
from .options import DATASETS, KEY_VALUE_OPTIONS, PRECISIONS, SCHEDULES, OptionParser, build_parser
from .preemption import parse_signals
from .run_dir import RUN_KEYS, WHICH, is_run_dir, read_run_config


class Config(dict):
    """The resolved options: a dict (for YAML and trackers) that also reads as attributes (``cfg.lr``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


def load_yaml(path: str | Path) -> dict:
    """Read a recipe, following ``_base_`` files first (relative to the file that names them)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of option: value")
    bases = data.pop("_base_", [])
    merged: dict = {}
    for base in [bases] if isinstance(bases, str) else bases:
        merged.update(load_yaml(path.parent / base))
    merged.update(data)
    return merged


# What --eval-only RUN_DIR takes from the run: its model and data (RUN_KEYS), and its loader processes (the
# parser's default would start workers where the run had none, as on a small machine or data set).
EVALUATED_RUN_KEYS = (*RUN_KEYS, "workers")


def _evaluated_run_options(known: argparse.Namespace) -> dict:
    """With --eval-only RUN_DIR (or --eval-only --checkpoint RUN_DIR): the run's EVALUATED_RUN_KEYS options,
    below the -c recipe and the command line."""
    target = known.eval_only if isinstance(known.eval_only, str) else known.checkpoint if known.eval_only else None
    if target is None or not is_run_dir(target):
        return {}
    try:
        options = read_run_config(target)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return {key: options[key] for key in EVALUATED_RUN_KEYS if key in options}


def _as_dict(value: Any, key: str) -> dict:
    """KEY=VALUE options arrive as a list of pairs (command line) or a mapping (YAML)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list) and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        return dict(value)
    raise ConfigError(f"{key} must be a mapping (YAML) or KEY=VALUE pairs, got {value!r}")


def parse_config(argv: list[str] | None) -> Config:
    """Parse argv (with its ``-c`` recipe) into a validated Config. Raises ConfigError."""
    parser = build_parser()
    config_only = OptionParser(add_help=False)
    config_only.add_argument("-c", "--config", default=None)
    config_only.add_argument("--eval-only", nargs="?", const=True, default=False)
    config_only.add_argument("--checkpoint", default=None)
    known, _ = config_only.parse_known_args(argv)
    file_cfg = load_yaml(known.config) if known.config else {}
    file_cfg = {**_evaluated_run_options(known), **file_cfg}

    dests = {a.dest for a in parser._actions} - {"help"}
    for key in file_cfg:
        if key not in dests:
            close = difflib.get_close_matches(key, dests, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown option '{key}' in {known.config}{hint}")
    plain = {k: v for k, v in file_cfg.items() if k not in KEY_VALUE_OPTIONS}
    parser.set_defaults(**plain)
    args = vars(parser.parse_args(argv))
    for key in KEY_VALUE_OPTIONS:  # merged key by key: the command line wins per key
        args[key] = {**_as_dict(file_cfg.get(key), key), **_as_dict(args[key], f"--{key.replace('_', '-')}")}
    cfg = Config(args)
    validate(cfg)
    return cfg


# Data and loader options: checked here before any work, and by engine.data for callers that build data
# without a config (robustness, protocols). One rule per option: (is the value valid?, what is expected).
DATA_RULES = {
    "train_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "num_classes": (lambda v: v is None or v >= 2, "at least 2"),
    "img_size": (lambda v: v is None or v >= 1, "a positive integer"),
    "batch_size": (lambda v: v >= 1, "a positive integer"),
    "workers": (lambda v: v >= 0, ">= 0"),
    "repeated_aug": (lambda v: v >= 1, ">= 1 (1: each image once)"),
}


def check_data_option(name: str, value: Any) -> None:
    """ConfigError (a ValueError) naming the option when `value` breaks DATA_RULES[name]."""
    valid, expected = DATA_RULES[name]
    if not valid(value):
        raise ConfigError(f"--{name.replace('_', '-')} must be {expected}, got {value}")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_type(cfg: Config, key: str, kind: type | tuple) -> None:
    value = cfg[key]
    if value is None:
        return
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        cfg[key] = float(value)
        return
    _check(
        isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)),
        f"--{key.replace('_', '-')} expects {getattr(kind, '__name__', kind)}, got {value!r}",
    )


def _option_name(key: str) -> str:
    return f"--{key.replace('_', '-')}"


def _check_option_types(cfg: Config, parser: argparse.ArgumentParser) -> None:
    """Every value (a YAML recipe's included, which skip argparse's conversion) against its option: lists
    of the option's item type and length, strings, and finite numbers (inf and nan make no sense here)."""
    for action in parser._actions:
        key, value = action.dest, cfg.get(action.dest)
        if value is None or key in KEY_VALUE_OPTIONS or key == "eval_only":
            continue
        kind = action.type or str
        if action.nargs == 0:  # flags: bools, checked with the other defaults' types
            continue
        if isinstance(action.nargs, int) or action.nargs in ("*", "+"):
            count = f"{action.nargs} " if isinstance(action.nargs, int) else ""
            expected = f"{_option_name(key)} expects a list of {count}{kind.__name__} values"
            if isinstance(value, str) and kind is str:  # a YAML string of space-separated items
                continue
            _check(isinstance(value, list), f"{expected}, got {value!r}")
            _check(not isinstance(action.nargs, int) or len(value) == action.nargs, f"{expected}, got {value!r}")
            if kind is float:
                value = cfg[key] = [float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
            _check(all(isinstance(v, kind) and not isinstance(v, bool) for v in value), f"{expected}, got {value!r}")
        elif kind is str and action.nargs is None and action.const is None and action.default is None:
            _check(isinstance(value, str), f"{_option_name(key)} expects a string, got {value!r}")
        values = value if isinstance(value, list) else [value]
        if kind is float:
            bad = [v for v in values if isinstance(v, float) and not math.isfinite(v)]
            _check(not bad, f"{_option_name(key)} must be a finite number, got {bad[0] if bad else ''}")


def check_output_dir(output: str | Path) -> None:
    """--output must be (or become) a writable directory: checked before any set-up, nothing created."""
    path = Path(output)
    _check(not path.exists() or path.is_dir(), f"--output {path} is a file; pass a directory (new or of this run)")
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    _check(ancestor.is_dir(), f"--output {path}: {ancestor} is a file, not a directory")
    _check(
        os.access(ancestor, os.W_OK | os.X_OK), f"--output {path}: {ancestor} is not writable; choose another --output"
    )


def config_warnings(cfg: Config) -> list[str]:
    """Valid but probably unintended settings, printed as `warning: ...` lines before the run starts."""
    warnings = []
    epochs, warmup = effective_epochs(cfg)
    if not cfg.eval_only and warmup >= epochs:
        warnings.append(
            f"--warmup-epochs {warmup} covers the whole run of {epochs} epoch(s): the lr only ramps up "
            f"from --warmup-lr and never reaches its peak; lower --warmup-epochs"
        )
    return warnings


def validate(cfg: Config) -> None:
    """Checks that need no model and no data: names, ranges, paths. Raises ConfigError."""
    from .streams import is_factory_source  # streams loads torch: only after parsing (`train.py --help` loads none)

    if isinstance(cfg.eval_only, str):  # --eval-only RUN_OR_WEIGHTS is --eval-only --checkpoint RUN_OR_WEIGHTS
        _check(
            cfg.checkpoint in (None, cfg.eval_only),
            f"--eval-only {cfg.eval_only} and --checkpoint {cfg.checkpoint} name different weights; give one",
        )
        cfg.checkpoint, cfg.eval_only = cfg.eval_only, True
    _check(cfg.get("which") in (None, *WHICH), f"--which must be one of {', '.join(WHICH)}, got {cfg.get('which')!r}")
    _check_option_types(cfg, build_parser())
    defaults = vars(build_parser().parse_args([]))
    for key, default in defaults.items():  # YAML values skip argparse's type conversion
        if isinstance(default, (bool, int, float, str)) and key in cfg:
            _check_type(cfg, key, type(default))
    for key in ("lr", "clip_grad", "output_scale"):
        _check_type(cfg, key, float)
    for key in ("num_classes", "eval_batch_size", "reparametrize_at_epoch", "img_size"):
        _check_type(cfg, key, int)

    _check(isinstance(cfg.model, str), "no model given: pass --model NAME (or 'model:' in the -c recipe)")
    _check(
        isinstance(cfg.save_epochs, list) and all(isinstance(e, int) for e in cfg.save_epochs),
        f"--save-epochs expects integers, got {cfg.save_epochs!r}",
    )
    _check(
        cfg.dataset in DATASETS or is_factory_source(cfg.dataset),
        f"unknown dataset '{cfg.dataset}'; choices: {', '.join(DATASETS)}, wds/NAME (tar shards), "
        f"hfids/NAME (Hugging Face datasets, streamed) or hfds/NAME (Hugging Face datasets)",
    )
    _check(cfg.sched in SCHEDULES, f"unknown --sched '{cfg.sched}'; choices: {', '.join(SCHEDULES)}")
    _check(
        cfg.mixed_precision in PRECISIONS,
        f"unknown --mixed-precision '{cfg.mixed_precision}'; choices: {', '.join(PRECISIONS)}",
    )
    _check(cfg.epochs >= 1 or cfg.eval_only, f"--epochs must be a positive integer, got {cfg.epochs}")
    _check(cfg.warmup_epochs >= 0, f"--warmup-epochs must be >= 0, got {cfg.warmup_epochs}")
    _check(cfg.lr is None or cfg.lr > 0, f"--lr must be positive, got {cfg.lr}")
    _check(cfg.lr_base > 0 and cfg.lr_base_size > 0, "--lr-base and --lr-base-size must be positive")
    _check(cfg.min_lr >= 0 and cfg.warmup_lr >= 0, "--min-lr and --warmup-lr must be >= 0")
    _check(cfg.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    _check(cfg.eval_batch_size is None or cfg.eval_batch_size >= 1, "--eval-batch-size must be positive")
    _check(cfg.grad_accum_steps >= 1, f"--grad-accum-steps must be >= 1, got {cfg.grad_accum_steps}")
    _check(cfg.eval_interval >= 1, f"--eval-interval must be >= 1, got {cfg.eval_interval}")
    for name in DATA_RULES:  # the same rules engine.data applies to its own arguments
        check_data_option(name, cfg[name])
    _check(cfg.mixup >= 0 and cfg.cutmix >= 0, "--mixup and --cutmix must be >= 0")
    _check(0 <= cfg.smoothing < 1, f"--smoothing must be in [0, 1), got {cfg.smoothing}")
    _check(0 <= cfg.reprob <= 1, f"--reprob must be in [0, 1], got {cfg.reprob}")
    _check(0 < cfg.crop_pct <= 1, f"--crop-pct must be in (0, 1], got {cfg.crop_pct}")
    _check(0 <= cfg.drop_path < 1, f"--drop-path must be in [0, 1), got {cfg.drop_path}")
    _check(cfg.clip_grad is None or cfg.clip_grad > 0, "--clip-grad must be positive")
    _check(
        cfg.output_scale is None or 0 < cfg.output_scale < math.inf,
        f"--output-scale must be a positive finite number (the output scale alpha), got {cfg.output_scale}",
    )
    _check(
        cfg.output_scale is None or not (cfg.reparametrize or cfg.distill_teacher),
        "--output-scale cannot be combined with --reparametrize or hard distillation",
    )
    _check(0 <= cfg.model_ema_decay < 1, "--model-ema-decay must be in [0, 1)")
    _check(
        cfg.compile_mode in COMPILE_MODES,
        f"unknown --compile-mode '{cfg.compile_mode}'; choices: {', '.join(COMPILE_MODES)}",
    )
    if cfg.compile:
        import torch  # only with --compile: `train.py --help` loads no torch

        backends = torch.compiler.list_backends(exclude_tags=())
        _check(
            cfg.compile_backend in backends,
            f"unknown --compile-backend '{cfg.compile_backend}'; choices: {', '.join(backends)}",
        )
    _check(cfg.keep_checkpoints >= 1, f"--keep-checkpoints must be >= 1, got {cfg.keep_checkpoints}")
    _check(cfg.checkpoint_interval >= 0, f"--checkpoint-interval must be >= 0 (0: off), got {cfg.checkpoint_interval}")
    signals = cfg.preempt_signals
    if isinstance(signals, str):
        signals = signals.split()
    _check(isinstance(signals, list), f"--preempt-signals expects signal names, got {signals!r}")
    cfg.preempt_signals = [] if [str(s).lower() for s in signals] in (["none"], []) else [str(s) for s in signals]
    try:
        parse_signals(cfg.preempt_signals)
    except ValueError as e:
        raise ConfigError(str(e)) from None

    if cfg.no_aug:  # one switch for every augmentation, so the data layer and the loss agree
        cfg.update(aa=None, reprob=0.0, color_jitter=0.0, hflip=0.0, mixup=0.0, cutmix=0.0, smoothing=0.0)
    if isinstance(cfg.aa, str) and cfg.aa.lower() in ("none", ""):
        cfg.aa = None
    _check(
        (cfg.mixup == 0 and cfg.cutmix == 0) or cfg.batch_size % 2 == 0,
        f"mixup/cutmix need an even --batch-size, got {cfg.batch_size}",
    )

    from timm.optim import list_optimizers  # timm loads torch: only after parsing (`train.py --help` loads none)

    _check(cfg.opt.lower() in list_optimizers(), f"unknown --opt '{cfg.opt}'; see timm.optim.list_optimizers()")
    for pattern, lr in cfg.param_group_lr.items():
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"--param-group-lr: '{pattern}' is not a regular expression ({e})") from None
        _check(
            isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < math.inf,
            f"--param-group-lr {pattern}=... needs a positive number, got {lr!r}",
        )

    for key in ("pretrained_file", "checkpoint", "distill_teacher_file"):  # data_dir: engine.data names the layout
        if cfg[key] is not None:
            _check(Path(cfg[key]).exists(), f"--{key.replace('_', '-')}: path does not exist: {cfg[key]}")
    if cfg.pretrained_file:
        cfg.pretrained = True
    _check(not cfg.eval_only or cfg.checkpoint, "--eval-only needs --checkpoint PATH (a weights file or run dir)")
    _check(
        bool(cfg.distill_teacher) == bool(cfg.distill_teacher_file),
        "hard distillation needs both --distill-teacher NAME and --distill-teacher-file PATH",
    )
    for epoch in cfg.save_epochs:
        _check(
            0 <= epoch <= effective_epochs(cfg)[0], f"--save-epochs {epoch} is outside 0..{effective_epochs(cfg)[0]}"
        )
    if cfg.reparametrize_at_epoch is not None:
        _check(
            0 <= cfg.reparametrize_at_epoch < effective_epochs(cfg)[0],
            f"--reparametrize-at-epoch must be in 0..{effective_epochs(cfg)[0] - 1}, got {cfg.reparametrize_at_epoch}",
        )
    if cfg.output is None:
        cfg.output = str(Path("runs") / f"{cfg.model}-{cfg.dataset}")
    if not cfg.eval_only:
        check_output_dir(cfg.output)


def effective_epochs(cfg: Config) -> tuple[int, int]:
    """(epochs, warmup epochs) after ``--scale-epochs``: both x 1/train_fraction, rounded up."""
    if not cfg.scale_epochs:
        return cfg.epochs, cfg.warmup_epochs
    scale = 1.0 / cfg.train_fraction
    return math.ceil(cfg.epochs * scale - 1e-9), math.ceil(cfg.warmup_epochs * scale - 1e-9)


def write_config(cfg: Config, path: Path, derived: dict) -> None:
    """The resolved options as a reloadable recipe; derived values (lr, global batch...) as comments."""
    header = "".join(f"# {key}: {value}\n" for key, value in derived.items())
    body = yaml.safe_dump(dict(cfg), sort_keys=False)
    write_text(path, "# resolved config of this run; reload with -c\n" + header + body)
