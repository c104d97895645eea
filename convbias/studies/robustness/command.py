"""Robustness of a trained model (Sec. 8.3.3, Table G.1, Fig. 8.3): clean top-1, FGSM and PGD
accuracy, common corruptions (generated on the fly, or an ImageNet-C folder), ImageNet-A/-R.

    convbias-robustness runs/demo --max-images 200 --output runs/demo/robustness
    convbias-robustness runs/tcnn_resnetrs50 --which best \\
        --imagenet-c /data/imagenet-c --imagenet-a /data/imagenet-a --imagenet-r /data/imagenet-r \\
        --compare-model resnetrs50 --compare-checkpoint resnetrs50.safetensors \\
        --output runs/tcnn_resnetrs50/robustness

The first argument is a train.py run (its config.yaml gives the model, its kwargs and the data; --which
last|best picks its checkpoint, RUN/checkpoints/epoch_NNNN/model.safetensors) or a weights file (with
--model). Writes OUTPUT/robustness.csv and .md (one row per model: the checkpoint evaluated, clean, C, A,
R, FGSM and PGD with their eps and PGD steps), corruptions.csv (top-1 per corruption and severity),
corruption_errors.csv (CE per category) and, with --compare-model, improvement.png (Fig. 8.3: gain of the
model over the compared one). What stops it is one `error: ...` line: bad input or a run without that
checkpoint (exit status 2), a damaged weights file of a run (65), an output that cannot be written (74).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from convbias.base.command_line import OptionParser, Typed, add_device_option, key_value
from convbias.base.devices import default_device
from convbias.base.reporting import run_command
from convbias.base.run_layout import ROBUSTNESS_FOLDER
from convbias.base.storage import check_output
from convbias.engine import (
    DEFAULT_WHICH,
    POSITIVE_INT,
    WHICH,
    Check,
    ConfigError,
    RunDir,
    check_model_name,
    declared,
    is_run_dir,
    run_model_spec,
)
from convbias.families import Families, load_families

from .corruptions import CORRUPTIONS, SEVERITIES
from .measure import PAPER_ATTACK
from .report import table_markdown
from .study import (
    IMAGENET_C_LAYOUT,
    SUBSET_LAYOUT,
    RobustnessOptions,
    RobustnessStudy,
    evaluate,
)

DATASET_CHOICES = ("digits", "cifar10", "cifar100", "imagenet", "folder")
PIXEL_SCALE = 255  # attack budgets are on the 0-255 pixel scale: a budget above it leaves the image range
BUDGET = Check(lambda v: 0 <= v <= PIXEL_SCALE, f"in [0, {PIXEL_SCALE}] (the 0-255 pixel scale)")
STEP = Check(lambda v: 0 < v <= PIXEL_SCALE, f"in (0, {PIXEL_SCALE}] (the 0-255 pixel scale)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows the defaults and the module docstring's examples as written."""


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(
        prog="convbias-robustness",
        usage="%(prog)s RUN_OR_WEIGHTS [options]",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "source",
        nargs="?",
        metavar="RUN_OR_WEIGHTS",
        help="a train.py run folder (its config.yaml gives --model, --model-kwargs, --dataset, --data-dir, "
        "--first-classes, --img-size unless given), a checkpoint folder or a safetensors / state-dict file",
    )
    p.add_argument("--which", choices=WHICH, default=DEFAULT_WHICH, help="checkpoint of a run folder")
    p.add_argument("--model", help="timm model name (any registered name); default: the run folder's")
    p.add_argument(
        "--model-kwargs", nargs="*", type=key_value, default=[], metavar="K=V", help="extra timm.create_model arguments"
    )
    p.add_argument("--compare-model", help="baseline model for the comparison (e.g. the CNN of a T-CNN)")
    p.add_argument("--compare-checkpoint", help="weights of --compare-model (same forms as RUN_OR_WEIGHTS)")
    p.add_argument("--compare-model-kwargs", nargs="*", type=key_value, default=[], metavar="K=V")
    p.add_argument(
        "--dataset",
        choices=DATASET_CHOICES,
        help="clean evaluation set (as train.py); default: the run folder's, else digits",
    )
    p.add_argument("--data-dir", help="dataset folder (as train.py)")
    p.add_argument("--first-classes", **declared("first_classes"), help="first N classes only (as train.py)")
    p.add_argument("--img-size", **declared("img_size"), help="evaluation resolution (None: the dataset's default)")
    p.add_argument(
        "--eps", type=Typed(float, BUDGET), default=PAPER_ATTACK["eps"], help="attack budget, 0-255 pixel scale"
    )
    p.add_argument("--pgd-steps", type=Typed(int, POSITIVE_INT), default=PAPER_ATTACK["pgd_steps"])
    p.add_argument(
        "--pgd-step-size", type=Typed(float, STEP), default=PAPER_ATTACK["pgd_step_size"], help="0-255 pixel scale"
    )
    p.add_argument(
        "--pgd-random-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start PGD at a uniform point of the eps-ball (foolbox default)",
    )
    p.add_argument("--attacks", nargs="+", default=["fgsm", "pgd"], choices=["fgsm", "pgd", "none"])
    p.add_argument(
        "--corruptions",
        nargs="+",
        default=["all"],
        choices=("all", "none", *CORRUPTIONS),
        metavar="NAME",
        help=f"'all', 'none' or some of: {', '.join(CORRUPTIONS)}",
    )
    p.add_argument("--severities", nargs="+", type=Typed(int), choices=SEVERITIES, default=list(SEVERITIES))
    p.add_argument(
        "--imagenet-c", metavar="DIR", help=f"ImageNet-C copy, {IMAGENET_C_LAYOUT}; replaces the generated corruptions"
    )
    p.add_argument("--imagenet-a", metavar="DIR", help=SUBSET_LAYOUT)
    p.add_argument("--imagenet-r", metavar="DIR", help=SUBSET_LAYOUT)
    p.add_argument(
        "--imagenet-classes",
        metavar="PATH",
        help="the model's classes in logit order, for the -C/-A/-R folders: an ImageNet train "
        "folder (sorted wnid folders) or a wnid list file; default: the --dataset classes",
    )
    p.add_argument(
        "--max-images", type=Typed(int, POSITIVE_INT), help="evaluate on a fixed random subset of N images per dataset"
    )
    p.add_argument("--batch-size", **declared("batch_size"), default=64)
    p.add_argument("--workers", **declared("workers"), default=2)
    p.add_argument("--seed", **declared("seed"), default=0, help="subset, corruption and PGD randomness")
    add_device_option(p)
    p.add_argument("--output", default="robustness", help="output folder")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check everything that needs no data or model."""
    args = build_parser().parse_args(argv)
    check_output(args.output, owned=ROBUSTNESS_FOLDER)  # before any run is read or model evaluated
    args.checkpoint = args.source
    del args.source  # one name for the weights, as robustness.json records them
    if not args.checkpoint:
        raise ConfigError("give the run or weights to evaluate as the first argument: convbias-robustness RUN ...")
    args.device = args.device or default_device()
    args.attacks = [] if "none" in args.attacks else list(dict.fromkeys(args.attacks))
    if args.corruptions == ["all"]:
        args.corruptions = list(CORRUPTIONS)
    elif args.corruptions == ["none"]:
        args.corruptions = []
    elif {"all", "none"} & set(args.corruptions):
        raise ConfigError(f"--corruptions {' '.join(args.corruptions)}: 'all' and 'none' stand alone")
    if bool(args.compare_model) != bool(args.compare_checkpoint):
        raise ConfigError("--compare-model and --compare-checkpoint go together")
    for option, path in (("run or weights", args.checkpoint), ("--compare-checkpoint", args.compare_checkpoint)):
        if path and not Path(path).exists():
            raise ConfigError(f"{option} {path} does not exist")
    for option, path in (("--imagenet-a", args.imagenet_a), ("--imagenet-r", args.imagenet_r)):
        if path and not Path(path).is_dir():
            raise ConfigError(f"{option} {path} is not a directory; expected {SUBSET_LAYOUT}")
    if args.imagenet_c and not args.corruptions:
        raise ConfigError("--imagenet-c given with --corruptions none")
    args.model_kwargs, args.compare_model_kwargs = dict(args.model_kwargs), dict(args.compare_model_kwargs)
    _take_run_options(args)
    if args.model is None:
        raise ConfigError(f"{args.checkpoint} is not a run folder: pass --model NAME")
    args.dataset = args.dataset or "digits"
    for option, name in (("--model", args.model), ("--compare-model", args.compare_model)):
        if name:
            check_model_name(name, option)
    return args


RUN_OPTIONS = ("model", "dataset", "data_dir", "first_classes", "img_size")
# the run's data options, as engine.rundir.reader's RUN_KEYS
RUN_DATA_OPTIONS = ("crop_pct", "interpolation", "in_chans", "mean", "std", "class_map", "input_key", "target_key")
RUN_MODEL_OPTIONS = (
    "bn_eps",
    "gp",
    "num_classes",
)  # what the run's model is built with besides its kwargs, for evaluation


def _take_run_options(args: argparse.Namespace) -> None:
    """RUN_OR_WEIGHTS / --compare-checkpoint naming train.py runs: their config.yaml fills the options not given,
    and --which picks their checkpoint, named on stderr and in the table with its epoch."""
    for option, model_key in (("checkpoint", "model"), ("compare_checkpoint", "compare_model")):
        run = getattr(args, option)
        if not run or not is_run_dir(run):
            continue
        run_dir = RunDir(run)
        options = run_dir.options()
        kwargs_key = f"{model_key}_kwargs"
        setattr(args, kwargs_key, {**(options.get("model_kwargs") or {}), **getattr(args, kwargs_key)})
        options = {**options, "num_classes": run_model_spec(run_dir, args.which or "last")["num_classes"]}  # the head
        setattr(args, f"{model_key}_options", {k: options[k] for k in RUN_MODEL_OPTIONS if options.get(k) is not None})
        if getattr(args, model_key) is None:
            setattr(args, model_key, options.get("model"))
        if option == "checkpoint":
            for key in RUN_OPTIONS[1:]:
                if getattr(args, key) is None:
                    setattr(args, key, options.get(key))
            # the run's evaluation transform, so that clean accuracy is the run's own top-1
            args.eval_transform = {key: options[key] for key in RUN_DATA_OPTIONS if options.get(key) is not None}
        chosen = run_dir.checkpoint(args.which)  # verified against its manifest
        setattr(args, option, str(chosen.weights))
        setattr(args, f"{option}_label", chosen.describe())
        setattr(args, f"{option}_run", run)
        print(f"{getattr(args, model_key)}: {chosen.describe()}", file=sys.stderr)


def _options(args: argparse.Namespace) -> RobustnessOptions:
    """The study's options from the parsed command line (eval_transform only for a run folder)."""
    return RobustnessOptions(
        **{f.name: getattr(args, f.name) for f in fields(RobustnessOptions) if hasattr(args, f.name)}
    )


def main(argv: list[str] | None = None, families: Families | None = None) -> int:
    """``families``: the loaded families (``load_families()`` when not given): their models are registered."""
    return run_command(lambda: _evaluate(argv, families))


def _evaluate(argv: list[str] | None, families: Families | None) -> None:
    families = families or load_families()  # registers their models: --model is checked against the registry
    args = parse_args(argv)
    study = RobustnessStudy(_options(args))
    result = evaluate(study, settings=vars(args))
    print(table_markdown(result["table"]), end="")
    print("wrote " + ", ".join(str(path) for path in result["files"].values()))


if __name__ == "__main__":
    raise SystemExit(main())
