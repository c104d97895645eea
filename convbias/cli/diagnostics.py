"""Draw the locality diagnostics of ConViT / DeiT / T-CNN runs as PNG files.

History figures of train.py runs (from their log.jsonl, which train.py writes with --diagnostics, the default):
    convbias-diagnostics runs/demo runs/demo_seed1 --output figures
  -> nonlocality.png (Fig. 7.6, one panel per run), gating_<run>.png (Fig. 7.7) and span_<run>.png
     (Fig. 8.4B) for each run with gated layers; the default --output is <first run>/figures.

Attention maps of one image (Fig. 7.8), with the first run's model and weights (and its history figures):
    python -c "from sklearn.datasets import load_digits; from PIL import Image; \\
        Image.fromarray((load_digits().images[0] * 15).astype('uint8')).save('digit.png')"
    convbias-diagnostics runs/demo --which best --image digit.png --layers 1 6
  -> attention_maps.png. The run's config.yaml and checkpoint give the model, its kwargs, image size,
     channels and classes (options given override them); --which last|best picks the checkpoint
     (RUN/checkpoints/epoch_NNNN/model.safetensors), whose weights are checked against their manifest first.
Or of any timm model, at its initialization or with a weights file (--checkpoint):
    convbias-diagnostics --model convit_tiny --image digit.png --output figures

What stops it is one `error: ...` line: bad input or a run without that checkpoint (exit status 2), a
damaged weights file (65), a figure that cannot be written (74).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import timm
import torch
from PIL import Image, UnidentifiedImageError
from timm.data import create_transform, resolve_data_config

from convbias import families
from convbias.base.deprecation import Deprecated, announce
from convbias.base.errors import ConfigError
from convbias.base.run_layout import LOG_FILE
from convbias.base.weights import load_weights
from convbias.cli import OptionParser, key_value, run_command
from convbias.engine import DEFAULT_WHICH, WHICH, Config, RunDir, create_model, is_run_dir
from convbias.engine.config.command_line import Typed, declared
from convbias.engine.config.options import NON_NEGATIVE, POSITIVE_INT
from convbias.engine.loop.records import read_log as read_run_log
from convbias.evaluation.figures import metric_history, plot_attention_maps, plot_nonlocality, plot_per_head


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
    parser.add_argument(
        "--run",
        nargs="+",
        default=[],
        action=Deprecated,
        help=argparse.SUPPRESS,
        note="give the runs as the first arguments: convbias-diagnostics {} ...",
    )
    parser.add_argument("--model", help="timm model name, to draw the attention maps of --image")
    parser.add_argument(
        "--checkpoint",
        action=Deprecated,
        when=is_run_dir,
        note="give the run as the first argument: convbias-diagnostics {} --image IMAGE ...",
        help="weights of --model (safetensors or any state dict); default: the model's initialization",
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
    parser.add_argument("--out", dest="output", action=Deprecated, help=argparse.SUPPRESS, note="use --output {}")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check everything that needs no model; a run's model options are read here."""
    parser = build_parser()
    args = parser.parse_args(argv)
    announce(args)
    args.runs = [*args.runs, *args.run]
    del args.run
    args.model_kwargs = dict(args.model_kwargs)
    for run in args.runs:
        if not Path(run).is_dir():
            parser.error(f"{run}: not a run directory (a timm model's weights: --model NAME --checkpoint FILE)")
        if not args.image and not (Path(run) / LOG_FILE).is_file():
            parser.error(f"{run}: no log.jsonl in this directory")
    if args.image and args.runs and not (args.model or args.checkpoint):
        if not is_run_dir(args.runs[0]):
            parser.error(f"{args.runs[0]}: no config.yaml, so no model for the attention maps: give --model")
        args.checkpoint = args.runs[0]  # the first run gives the model and its weights
    if args.checkpoint and is_run_dir(args.checkpoint):
        _take_run_options(args)  # its faults are one line (main): no checkpoint 2, damaged weights 65
    args.in_chans = args.in_chans or 3
    families.load_families()
    if not args.runs and not args.model:
        parser.error("give run directories (history figures) and/or --image with a run or --model (attention maps)")
    if args.model:
        if not timm.is_model(args.model):
            parser.error(f"--model {args.model}: not a registered timm model")
        if not args.image:
            parser.error("--model needs --image")
    if args.image and not args.model:
        parser.error("--image needs a run directory or --model")
    if args.image and not Path(args.image).is_file():
        parser.error(f"--image {args.image}: file not found")
    if args.checkpoint and not Path(args.checkpoint).exists():
        parser.error(f"--checkpoint {args.checkpoint}: no such file or directory")
    if args.output is None:
        args.output = str(Path(args.runs[0]) / "figures") if args.runs else "figures"
    return args


def _take_run_options(args: argparse.Namespace) -> None:
    """The maps' run: its model, kwargs, image size, channels and classes for the options not given."""
    args.weights_run = RunDir(args.checkpoint)  # loads the point chosen, or the next if the run removes it
    spec = args.weights_run.model_spec(args.which)
    args.model = args.model or spec["model"]
    args.model_kwargs = {**spec["model_kwargs"], **args.model_kwargs}
    args.img_size = args.img_size or spec["img_size"]
    args.in_chans = args.in_chans or spec["in_chans"]
    args.num_classes = args.num_classes or spec["num_classes"]
    args.checkpoint = str(spec["checkpoint"].weights)
    print(f"{args.model}: {spec['checkpoint'].describe()}", file=sys.stderr)


def read_histories(runs: list[str], maps_too: bool) -> dict[str, list[dict]]:
    """{run name: log records} of the runs to draw. With attention maps to draw as well, a run whose log holds
    no locality values (trained with --no-diagnostics) is named in a note instead of stopping the command."""
    logs = {}
    for run in runs:
        log = Path(run) / LOG_FILE
        records, dropped = read_run_log(log)  # a damaged line (cut, not UTF-8, nested too deep) is dropped
        if dropped:
            print(f"note: {log}: dropped {dropped} damaged lines", file=sys.stderr)
        if maps_too and not metric_history(records, "nonlocality"):
            print(f"note: {run}: no locality values in its log.jsonl, so no history figures", file=sys.stderr)
            continue
        logs[Path(run).resolve().name] = records
    return logs


def draw_histories(logs: dict[str, list[dict]], out: Path) -> list[Path]:
    written = [plot_nonlocality(logs, out / "nonlocality.png")]
    for name, records in logs.items():
        for metric in ("gating", "span"):
            if any(key.startswith(f"{metric}/") for record in records for key in record):
                written.append(plot_per_head(records, metric, out / f"{metric}_{name}.png", title=name))
    return written


def load_image(path: str, model: torch.nn.Module, in_chans: int, img_size: int | None) -> torch.Tensor:
    """The image as the model sees it at evaluation (timm's eval transform for the model's config)."""
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


def draw_attention_maps(args: argparse.Namespace, out: Path) -> Path:
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
    if getattr(args, "weights_run", None) is not None:
        args.weights_run.load_weights(model, args.which)
    elif args.checkpoint:
        load_weights(model, args.checkpoint)
    image = load_image(args.image, model, args.in_chans, args.img_size)
    query = tuple(args.query) if args.query else None
    maps, queries, gates = families.query_maps(model, image, query=query, layers=args.layers)
    return plot_attention_maps(image, maps, queries, out / "attention_maps.png", gates=gates)


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: _draw(argv))


def _draw(argv: list[str] | None) -> None:
    args = parse_args(argv)
    out = Path(args.output)
    logs = read_histories(args.runs, maps_too=bool(args.image))
    written = draw_histories(logs, out) if logs else []
    if args.model:
        written.append(draw_attention_maps(args, out))
    for path in written:
        print(path)


if __name__ == "__main__":
    raise SystemExit(main())
