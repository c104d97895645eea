"""The command-line options of ``train.py``: their parser, defaults and help, and the argparse pieces the
project's other commands share (``OptionParser``, ``key_value``, ``yaml_scalar``).

Light to import: ``train.py --help`` builds this parser and nothing else.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import yaml

from .compile import COMPILE_MODES
from .errors import ConfigError
from .preemption import DEFAULT_SIGNALS, REQUEUE_EXIT_CODE
from .run_dir import DEFAULT_KEEP_CHECKPOINTS, DEFAULT_WHICH, WHICH

DESCRIPTION = "Run configuration: command-line options, YAML recipes (``-c``), and validation."  # first line of --help
DATASETS = ("digits", "mnist", "cifar10", "cifar100", "imagenet", "folder")
SCHEDULES = ("cosine", "step", "constant")
PRECISIONS = ("no", "bf16", "fp16")
KEY_VALUE_OPTIONS = ("model_kwargs", "reparametrize_kwargs", "param_group_lr")


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
        prog="train.py", description=DESCRIPTION, allow_abbrev=False, formatter_class=DefaultsHelpFormatter
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
        help="evaluate a run directory (its config.yaml gives the model, data and --workers; options given "
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
