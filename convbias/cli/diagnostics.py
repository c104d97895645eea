"""Draw the diagnostics a run's family logs (ConViT / DeiT / T-CNN locality, eFCN deviation) as PNG files.

History figures of train.py runs (from their log.jsonl, which train.py writes with --diagnostics, the default),
each from initialization (epoch 0) on, for the runs whose family logs its values:
    convbias-diagnostics runs/demo runs/demo_seed1 --output figures
  -> nonlocality.png (Fig. 7.6, one panel per run with attention maps: ConViT, DeiT), gating_<run>.png (Fig. 7.7)
     and span_<run>.png (Fig. 8.4B) for each run with gated layers (ConViT, T-CNN), deviation.png (one panel per
     eFCN or FCN run: the deviation from the CNN subspace); the default --output is <first run>/figures.

Attention maps of one image (Fig. 7.8), with the first run's model and weights (and its history figures):
    python -c "from sklearn.datasets import load_digits; from PIL import Image; \\
        Image.fromarray((load_digits().images[0] * 15).astype('uint8')).save('digit.png')"
    convbias-diagnostics runs/demo --which best --image digit.png --layers 1 6
  -> attention_maps.png. The run (or a convbias-export folder) gives the model, its weights and the image's
     preprocessing: its evaluation transform, as convbias-predict applies it; --which last|best picks the
     checkpoint (RUN/checkpoints/epoch_NNNN/model.safetensors), whose weights are checked against their manifest
     first.
Or of any timm model, at its initialization or with a weights file (--checkpoint), preprocessed as its pretrained
config says (--img-size, --in-chans, --num-classes and --model-kwargs build it):
    convbias-diagnostics --model convit_tiny --image digit.png --output figures

What stops it is one `error: ...` line, before any figure is written: bad input, a run without that checkpoint,
a run whose log holds none of these values or a model without attention maps (exit status 2), a damaged weights
file (65), a figure that cannot be written (74).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import timm
import torch
from PIL import Image, UnidentifiedImageError
from timm.data import create_transform, resolve_data_config

from convbias.base.command_line import OptionParser, Typed, key_value
from convbias.base.errors import ConfigError
from convbias.base.inputs import check_regular_file
from convbias.base.run_layout import LOG_FILE
from convbias.base.weights import load_weights
from convbias.cli import run_command
from convbias.engine import (
    DEFAULT_WHICH,
    NON_NEGATIVE,
    POSITIVE_INT,
    WHICH,
    Config,
    create_model,
    declared,
    is_run_dir,
    read_run_config,
)
from convbias.engine import read_log as read_run_log
from convbias.evaluation.figures import (
    HISTORY_METRICS,
    INIT_PREFIX,
    logs_metric,
    plot_attention_maps,
    plot_deviation,
    plot_nonlocality,
    plot_per_head,
)
from convbias.families import Families, load_families
from convbias.sharing.prediction import is_exported, load_predictor


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(
        prog="convbias-diagnostics",
        usage="%(prog)s [RUN ...] [--image IMAGE] [options]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "runs",
        nargs="*",
        metavar="RUN",
        help="train.py run directories: history figures from their log.jsonl; with --image the first one "
        "gives the model and its weights, unless --model or --checkpoint is given",
    )
    parser.add_argument("--model", help="timm model name, to draw the attention maps of --image")
    parser.add_argument(
        "--checkpoint", help="weights of --model (safetensors or any state dict); default: the model's initialization"
    )
    parser.add_argument("--which", choices=WHICH, default=DEFAULT_WHICH, help="checkpoint of the run (default: last)")
    parser.add_argument("--image", help="image file for the attention maps")
    parser.add_argument(
        "--img-size", **declared("img_size"), help="input size the model was trained at (default: the model's)"
    )
    parser.add_argument(
        "--num-classes", **declared("num_classes"), help="classifier size of the checkpoint (default: the model's)"
    )
    parser.add_argument(
        "--in-chans", **declared("in_chans"), help="input channels of the model (default: the run's, else 3)"
    )
    parser.add_argument(
        "--model-kwargs", nargs="*", type=key_value, default=[], metavar="K=V", help="extra model kwargs"
    )
    parser.add_argument(
        "--query",
        nargs=2,
        type=Typed(int, NON_NEGATIVE),
        metavar=("ROW", "COL"),
        help="query patch on the grid (default: center)",
    )
    parser.add_argument(
        "--layers", nargs="+", type=Typed(int, POSITIVE_INT), help="1-based attention layers to draw (default: all)"
    )
    parser.add_argument("--output", help="directory for the PNG files (default: <first run>/figures, else ./figures)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check everything that needs no model; a run's model options are read here. A --model is
    looked up in timm's registry: the families' models are registered first (``main``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.model_kwargs = dict(args.model_kwargs)
    for run in args.runs:
        if not Path(run).is_dir():
            parser.error(f"{run}: not a run directory (a timm model's weights: --model NAME --checkpoint FILE)")
        if not args.image and not (Path(run) / LOG_FILE).is_file():
            parser.error(f"{run}: no log.jsonl in this directory")
    args.maps_run = None  # the run (or exported folder) whose model, weights and preprocessing the maps use
    if args.image and args.runs and not (args.model or args.checkpoint):
        if not is_run_dir(args.runs[0]):
            parser.error(f"{args.runs[0]}: no config.yaml, so no model for the attention maps: give --model")
        args.maps_run = args.runs[0]  # the first run gives the model and its weights
    if args.maps_run:
        given = [flag for flag, value in _MODEL_OPTIONS.items() if getattr(args, value)]
        if given:
            parser.error(
                f"{', '.join(given)}: {args.maps_run} gives the model and the image's preprocessing (its evaluation "
                "transform); for another model, give --model NAME [--checkpoint FILE]"
            )
        args.model = None
    args.in_chans = args.in_chans or 3
    if not args.runs and not (args.model or args.maps_run):
        parser.error("give run directories (history figures) and/or --image with a run or --model (attention maps)")
    if args.model:
        if not timm.is_model(args.model):
            parser.error(f"--model {args.model}: not a registered timm model")
        if not args.image:
            parser.error("--model needs --image")
    if args.image and not (args.model or args.maps_run):
        parser.error("--image needs a run directory or --model")
    if args.image:
        try:
            check_regular_file(args.image, "--image")
        except ConfigError as error:
            parser.error(str(error))
    if args.checkpoint and not Path(args.checkpoint).exists():
        parser.error(f"--checkpoint {args.checkpoint}: no such file or directory")
    if args.output is None:
        args.output = str(Path(args.runs[0]) / "figures") if args.runs else "figures"
    return args


# the options that build a --model, which a run's own model and preprocessing replace
_MODEL_OPTIONS = {"--img-size": "img_size", "--num-classes": "num_classes", "--in-chans": "in_chans",
                  "--model-kwargs": "model_kwargs"}  # fmt: skip


def read_histories(runs: list[str], maps_too: bool) -> dict[str, list[dict]]:
    """{run name: log records} of the runs to draw. With attention maps to draw as well, a run whose log holds
    none of the values the history figures draw is named in a note instead of stopping the command."""
    logs = {}
    for run in runs:
        log = Path(run) / LOG_FILE
        if maps_too and not log.is_file():  # a convbias-export folder: a model and its weights, no history
            print(f"note: {run}: no {LOG_FILE} in it, so no history figures", file=sys.stderr)
            continue
        records, dropped = read_run_log(log)  # a damaged line (cut, not UTF-8, nested too deep) is dropped
        if dropped:
            print(f"note: {log}: dropped {dropped} damaged lines", file=sys.stderr)
        if maps_too and not any(logs_metric(records, metric) for metric in HISTORY_METRICS):
            print(f"note: {run}: {_nothing_to_draw(Path(run), records)}, so no history figures", file=sys.stderr)
            continue
        logs[Path(run).resolve().name] = records
    return logs


def _nothing_to_draw(run: Path, records: list[dict]) -> str:
    """Why a run's log gives no history figure: trained with --no-diagnostics, or a model whose family logs none of
    the values drawn (with the diagnostics it does log)."""
    what = f"its log.jsonl holds no {', '.join(f'{m}/' for m in HISTORY_METRICS)} values"
    try:
        options = read_run_config(run)
    except ConfigError:  # a folder with a log but no readable config: the log alone says it
        options = {}
    if not options:
        return f"{what} (and no readable config.yaml names its model)"
    if options.get("diagnostics") is False:
        return f"{what}: it was trained with --no-diagnostics"
    logged = sorted({key.removeprefix(INIT_PREFIX) for record in records for key in record if "/" in key})
    return (
        f"{what}: its model {options['model']} has no attention layer, gated layer or embedded convolution, the layers these figures "
        f"measure (its log's diagnostics: {', '.join(logged[:6]) + (', ...' if len(logged) > 6 else '') or 'none'})"
    )


def draw_histories(logs: dict[str, list[dict]], out: Path, runs: dict[str, Path] | None = None) -> list[Path]:
    """Each history figure for the runs whose logs hold its values: nonlocality.png and deviation.png with a panel
    per run, gating_<run>.png and span_<run>.png per run. A run with none of them is named in a note; ConfigError
    when no run has any (`runs`: {name: folder}, to say why)."""
    drawn = {name: [m for m in HISTORY_METRICS if logs_metric(records, m)] for name, records in logs.items()}
    runs = runs or {}
    if not any(drawn.values()):
        reasons = [
            f"{runs.get(name, name)}: {_nothing_to_draw(runs.get(name, Path(name)), logs[name])}" for name in logs
        ]
        raise ConfigError("; ".join(reasons))
    for name, metrics in drawn.items():
        if not metrics:
            print(
                f"note: {runs.get(name, name)}: {_nothing_to_draw(runs.get(name, Path(name)), logs[name])}",
                file=sys.stderr,
            )
    written = []
    for metric, plot in (("nonlocality", plot_nonlocality), ("deviation", plot_deviation)):
        panels = {name: logs[name] for name, metrics in drawn.items() if metric in metrics}
        if panels:
            written.append(plot(panels, out / f"{metric}.png"))
    for name, metrics in drawn.items():
        for metric in ("gating", "span"):
            if metric in metrics:
                written.append(plot_per_head(logs[name], metric, out / f"{metric}_{name}.png", title=name))
    return written


def load_image(path: str, model: torch.nn.Module, in_chans: int, img_size: int | None) -> torch.Tensor:
    """The image as a timm model without a run sees it at evaluation: timm's eval transform for its pretrained
    config (a run's maps use the run's own evaluation transform instead: `load_predictor`)."""
    overrides = {"input_size": (in_chans, img_size, img_size)} if img_size else {}
    config = resolve_data_config(overrides, model=model)
    if in_chans == 1:  # one channel: one mean and std
        config["mean"] = (sum(config["mean"]) / len(config["mean"]),)
        config["std"] = (sum(config["std"]) / len(config["std"]),)
    try:
        image = Image.open(path).convert("L" if in_chans == 1 else "RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise ConfigError(f"--image {path}: cannot read the image ({err})") from None
    return create_transform(**config)(image)


def model_and_image(args: argparse.Namespace, families: Families) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model the maps are drawn of and --image as it sees it: a run's (or exported folder's) model, weights
    and evaluation transform, through the one reader convbias-predict uses; or --model at its initialization or
    with --checkpoint's weights, with its pretrained config's preprocessing."""
    if args.maps_run:
        which = None if is_exported(args.maps_run) else args.which
        predictor = load_predictor(
            args.maps_run, families, which
        )  # its faults are one line: no checkpoint 2, damaged 65
        architecture = predictor.model.pretrained_cfg.get("architecture", type(predictor.model).__name__)
        print(f"{architecture}: {predictor.source}", file=sys.stderr)
        try:
            return predictor.model, predictor.image(args.image)
        except ConfigError as error:
            raise ConfigError(f"--image {error}") from None
    kwargs = dict(args.model_kwargs, in_chans=args.in_chans)
    if args.img_size:
        kwargs["img_size"] = args.img_size
    if args.num_classes:
        kwargs["num_classes"] = args.num_classes
    try:
        if args.num_classes:  # the engine's builder: CNNs (T-CNNs) take no img_size
            model = create_model(
                Config(model=args.model, model_kwargs=args.model_kwargs, img_size=args.img_size),
                args.num_classes,
                args.in_chans,
            )
        else:
            model = timm.create_model(args.model, **kwargs)
    except ConfigError:  # the engine's builder names what it refuses (a damaged file it reads: exit 65)
        raise
    except (TypeError, ValueError) as err:  # how timm's own models refuse their kwargs
        raise ConfigError(f"--model {args.model} with {kwargs}: {err}") from None
    if args.checkpoint:
        load_weights(model, args.checkpoint)
    return model.eval(), load_image(args.image, model, args.in_chans, args.img_size)


def main(argv: list[str] | None = None, families: Families | None = None) -> int:
    """``families``: the loaded families (``load_families()`` when not given), whose maps --image draws."""
    return run_command(lambda: _draw(argv, families))


def _draw(argv: list[str] | None, families: Families | None) -> None:
    families = families or load_families()  # registers the families' models: a --model is checked against them
    args = parse_args(argv)
    out = Path(args.output)
    maps = None
    if args.image:  # the model, its weights and its maps first: a refusal leaves no figure written
        model, image = model_and_image(args, families)
        query = tuple(args.query) if args.query else None
        maps = image, families.query_maps(model, image, query=query, layers=args.layers)
    logs = read_histories(args.runs, maps_too=maps is not None)
    folders = {Path(run).resolve().name: Path(run) for run in args.runs}
    written = draw_histories(logs, out, folders) if logs else []
    if maps is not None:
        image, (layer_maps, queries, gates) = maps
        written.append(plot_attention_maps(image, layer_maps, queries, out / "attention_maps.png", gates=gates))
    for path in written:
        print(path)


if __name__ == "__main__":
    raise SystemExit(main())
