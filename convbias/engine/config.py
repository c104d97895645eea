"""Run configuration: command-line options, YAML recipes (``-c``), and validation.

The option names follow timm's ``train.py``. A YAML key is the option name with ``_`` instead of ``-``
(``batch_size: 64``). Precedence: built-in defaults (the DeiT recipe) < YAML file(s) < command line.
A YAML file may name other files under ``_base_`` (a path or a list of paths relative to itself); they are
loaded first and the file's own keys override them.

Everything here runs before any work starts: a user mistake raises ``ConfigError`` with a one-line
message naming the option and the expected form; ``engine.main`` prints it as ``error: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

from .compile import COMPILE_MODES
from .errors import ConfigError
from .preemption import DEFAULT_SIGNALS, REQUEUE_EXIT_CODE, parse_signals
from .run_dir import DEFAULT_KEEP_CHECKPOINTS, DEFAULT_WHICH, RUN_KEYS, WHICH, is_run_dir, read_run_config
from .streams import is_factory_source

DATASETS = ("digits", "mnist", "cifar10", "cifar100", "imagenet", "folder")
SCHEDULES = ("cosine", "step", "constant")
PRECISIONS = ("no", "bf16", "fp16")
KEY_VALUE_OPTIONS = ("model_kwargs", "reparametrize_kwargs", "param_group_lr")


class Config(dict):
    """The resolved options: a dict (for YAML and trackers) that also reads as attributes (``cfg.lr``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


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
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return text if isinstance(value, (dict, list)) else value


def key_value(text: str) -> tuple[str, Any]:
    """argparse type of every K=V option of the project's commands: 'k=0.1' -> ('k', 0.1) (YAML scalars)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got '{text}'")
    return key, yaml_scalar(value)


def build_parser() -> argparse.ArgumentParser:
    """All options. Defaults are the DeiT recipe (Touvron et al. 2021) that the ConViT keeps unchanged."""
    p = OptionParser(
        prog="train.py", description=__doc__.split("\n")[0], allow_abbrev=False, formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("-c", "--config", default=None, help="YAML recipe; command-line options override it")
    flag = argparse.BooleanOptionalAction

    g = p.add_argument_group("model")
    g.add_argument(
        "--model", default=None, help="any model in timm's registry (train.py registers this project's families)"
    )
    g.add_argument("--pretrained", action=flag, default=False, help="start from pretrained weights")
    g.add_argument("--pretrained-file", default=None, help="local weights file for --pretrained (no download)")
    g.add_argument(
        "--model-kwargs",
        nargs="*",
        type=key_value,
        default=None,
        metavar="K=V",
        help="extra model constructor arguments, values parsed as YAML scalars (patch_size=4)",
    )
    g.add_argument("--drop-path", type=float, default=0.1, help="stochastic depth rate")
    g.add_argument("--num-classes", type=int, default=None, help="keep only the first K classes")
    g.add_argument("--img-size", type=int, default=None, help="default: the dataset's (224 for ImageNet)")
    g.add_argument(
        "--output-scale",
        type=float,
        default=None,
        metavar="ALPHA",
        help="train alpha (f_w - f_w0) with the loss / alpha^2 (the alpha-trick: large alpha = lazy, "
        "small = feature learning; the lr is not rescaled: see convbias.engine.output_scale for Adam)",
    )

    g = p.add_argument_group("data and augmentation")
    g.add_argument("--dataset", default="digits", help=f"one of {', '.join(DATASETS)}, wds/NAME, hfids/NAME, hfds/NAME")
    g.add_argument("--data-dir", default=None)
    g.add_argument("--train-fraction", type=float, default=1.0, help="keep this fraction of each class, in (0, 1]")
    g.add_argument(
        "--scale-epochs",
        action=flag,
        default=False,
        help="multiply epochs and warmup by 1/train-fraction (same number of images seen)",
    )
    g.add_argument("--workers", type=int, default=4, help="data loader processes per training process")
    g.add_argument("--aa", default="rand-m9-mstd0.5-inc1", help="timm auto-augment policy; none to disable")
    g.add_argument("--reprob", type=float, default=0.25, help="random erasing probability")
    g.add_argument("--color-jitter", type=float, default=0.3)
    g.add_argument("--interpolation", default="bicubic")
    g.add_argument("--crop-pct", type=float, default=0.875, help="eval center-crop fraction")
    g.add_argument("--hflip", type=float, default=0.5)
    g.add_argument(
        "--scale",
        type=float,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="random-resized-crop area range; default timm's (0.08, 1)",
    )
    g.add_argument(
        "--skip-unreadable", action=flag, default=True, help="skip (and count) unreadable images instead of stopping"
    )
    g.add_argument("--repeated-aug", type=int, default=3, help="repeated augmentation: copies of each image")
    g.add_argument("--mixup", type=float, default=0.8, help="mixup alpha; 0 disables")
    g.add_argument("--cutmix", type=float, default=1.0, help="cutmix alpha; 0 disables")
    g.add_argument("--smoothing", type=float, default=0.1, help="label smoothing")
    g.add_argument(
        "--no-aug",
        action="store_true",
        default=False,
        help="no augmentation at all (crop/flip, aa, mixup, cutmix, erasing, smoothing)",
    )

    g = p.add_argument_group("optimization")
    g.add_argument("--opt", default="adamw", help="timm optimizer name")
    g.add_argument("--lr", type=float, default=None, help="absolute lr; default lr-base x global batch / lr-base-size")
    g.add_argument("--lr-base", type=float, default=5e-4)
    g.add_argument("--lr-base-size", type=int, default=512)
    g.add_argument("--weight-decay", type=float, default=0.05)
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--opt-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=None, help="clip the gradient norm to this value")
    g.add_argument(
        "--param-group-lr",
        nargs="*",
        type=key_value,
        default=None,
        metavar="REGEX=LR",
        help="absolute lr for parameters whose name matches REGEX (gating_param=0.1)",
    )
    g.add_argument("--sched", default="cosine", help=f"one of {', '.join(SCHEDULES)}")
    g.add_argument("--epochs", type=int, default=300)
    g.add_argument("--warmup-epochs", type=int, default=5)
    g.add_argument("--warmup-lr", type=float, default=1e-6)
    g.add_argument("--min-lr", type=float, default=1e-5)
    g.add_argument("--decay-epochs", type=float, default=30, help="step schedule: epochs between decays")
    g.add_argument("--decay-rate", type=float, default=0.1, help="step schedule: lr factor per decay")

    g = p.add_argument_group("training")
    g.add_argument("--batch-size", type=int, default=64, help="per process")
    g.add_argument("--eval-batch-size", type=int, default=None, help="per process; default --batch-size")
    g.add_argument("--grad-accum-steps", type=int, default=1)
    g.add_argument("--mixed-precision", default="no", help=f"one of {', '.join(PRECISIONS)}")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--model-ema", action=flag, default=False, help="keep and evaluate an EMA of the weights")
    g.add_argument("--model-ema-decay", type=float, default=0.99996)
    g.add_argument("--distill-teacher", default=None, help="timm name of a CNN teacher (hard distillation)")
    g.add_argument("--distill-teacher-file", default=None, help="local weights of the teacher")
    g.add_argument(
        "--reparametrize",
        default=None,
        metavar="NAME",
        help="a change of architecture registered by the entry point (train.py registers tcnn)",
    )
    g.add_argument(
        "--reparametrize-at-epoch",
        type=int,
        default=None,
        help="apply --reparametrize NAME with --reparametrize-kwargs at the start of this epoch (0-based)",
    )
    g.add_argument("--reparametrize-kwargs", nargs="*", type=key_value, default=None, metavar="K=V")
    g.add_argument(
        "--compile",
        action=flag,
        default=False,
        help="torch.compile the training and evaluation forwards (checkpoints keep the model's own keys)",
    )
    g.add_argument("--compile-mode", default="default", help=f"one of {', '.join(COMPILE_MODES)}")
    g.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend (aot_eager: dynamo's graphs and autograd without code generation)",
    )
    g.add_argument(
        "--grad-checkpointing",
        action=flag,
        default=False,
        help="recompute block activations in backward (timm's set_grad_checkpointing): less memory",
    )

    g = p.add_argument_group("run, checkpoints and logging")
    g.add_argument("--output", default=None, help="output dir; default runs/<model>-<dataset>")
    g.add_argument("--resume", default=None, help="'auto' (the output dir's latest checkpoint) or a path")
    g.add_argument(
        "--eval-only",
        nargs="?",
        const=True,
        default=False,
        metavar="RUN_OR_WEIGHTS",
        help="evaluate a run directory (its config.yaml gives the model and data; options given "
        "override them) or --checkpoint, and print top-1/top-5",
    )
    g.add_argument(
        "--which",
        default=None,
        choices=WHICH,
        help=f"checkpoint of a run directory to evaluate or start from (default: {DEFAULT_WHICH})",
    )
    g.add_argument("--checkpoint", default=None, help="weights to evaluate or start from (a file or a run dir)")
    g.add_argument(
        "--save-epochs",
        nargs="*",
        type=int,
        default=[],
        metavar="E",
        help="also keep checkpoints/epoch_E.safetensors after E epochs (0 = the initial weights)",
    )
    g.add_argument(
        "--checkpoint-interval",
        type=int,
        default=0,
        metavar="STEPS",
        help="also write a mid-epoch resume point every STEPS optimizer updates (0: at epoch ends only)",
    )
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        default=DEFAULT_KEEP_CHECKPOINTS,
        metavar="K",
        help="resume points kept (the newest K, and best); --resume auto falls back to an older one when the "
        "newest is damaged",
    )
    g.add_argument(
        "--accept-resume-changes",
        action=flag,
        default=False,
        help="continue a mid-epoch resume point with another batch size, seed, data set or model options "
        "(not exact; recorded in log.jsonl)",
    )
    g.add_argument(
        "--preempt-signals",
        nargs="*",
        default=list(DEFAULT_SIGNALS),
        metavar="SIG",
        help="signals that stop the run after the current step with a resume point, exit code "
        f"{REQUEUE_EXIT_CODE} (none: off)",
    )
    g.add_argument("--eval-interval", type=int, default=1, help="evaluate every N epochs (and after the last)")
    g.add_argument("--diagnostics", action=flag, default=True, help="log model diagnostics every evaluation")
    g.add_argument("--diagnostics-images", type=int, default=16, help="fixed eval images used by diagnostics")
    g.add_argument("--log-wandb", action=flag, default=False, help="log to wandb (honors WANDB_MODE)")
    g.add_argument("--wandb-project", default="convolutional-inductive-biases")
    return p


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


def _evaluated_run_options(known: argparse.Namespace) -> dict:
    """With --eval-only RUN_DIR (or --eval-only --checkpoint RUN_DIR): the run's model and data options,
    below the -c recipe and the command line."""
    target = known.eval_only if isinstance(known.eval_only, str) else known.checkpoint if known.eval_only else None
    if target is None or not is_run_dir(target):
        return {}
    try:
        options = read_run_config(target)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return {key: options[key] for key in RUN_KEYS if key in options}


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
    path.write_text("# resolved config of this run; reload with -c\n" + header + body)
