"""`convbias-predict RUN_OR_EXPORTED_DIR IMAGES...`: label your own images with a trained model.

    convbias-predict runs/convit_tiny-digits photos/ extra/*.png --topk 3 --output preds.csv
    convbias-predict exported/tcnn_resnet18-digits cat.jpg --output preds.json

The model is a train.py run (--which last|best picks its checkpoint), a convbias-export folder, or timm's
train.py checkpoint (last.pth.tar, model_best.pth.tar: the model and preprocessing its saved arguments name,
--use-ema for its EMA's weights, as timm's validate.py); images are preprocessed as the run's validation images (resize and center crop at its img_size and crop_pct, its
interpolation, the dataset's mean and std and channels), and the input the model expects is printed first on
stderr (channels, size, normalization, dark or light images). IMAGES are files, folders (searched recursively
for image files) or glob patterns. Writes, for each image, the top-k classes with their label, index and
probability: CSV or JSON by the --output suffix (replaced atomically), CSV on standard output without
--output. An image that cannot be decoded is named on stderr and skipped, and counted at the end. What
stops it is one `error: ...` line: bad input (exit status 2), a damaged checkpoint of the run (65), an
output that cannot be written (74).
"""

from __future__ import annotations

import argparse
import sys

from convbias.base.command_line import OptionParser, Typed, add_device_option
from convbias.base.devices import default_device
from convbias.cli import run_command
from convbias.engine import POSITIVE_INT, WHICH, ConfigError
from convbias.families import Families, load_families


def main(argv: list[str] | None = None, families: Families | None = None) -> int:
    """``families``: the loaded families (``load_families()`` when not given), whose models it labels with."""
    return run_command(lambda: _predict(argv, families))


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(prog="convbias-predict", description=__doc__.split("\n")[0])
    parser.add_argument(
        "source", metavar="RUN_OR_EXPORTED_DIR", help="a train.py run, a convbias-export folder or timm's *.pth.tar"
    )
    parser.add_argument("images", nargs="+", metavar="IMAGES", help="image files, folders or glob patterns")
    parser.add_argument("--topk", type=Typed(int, POSITIVE_INT), default=5, help="classes reported per image")
    parser.add_argument("--output", help="a .csv or .json file to write (default: CSV on standard output)")
    parser.add_argument("--batch-size", type=Typed(int, POSITIVE_INT), default=64)
    add_device_option(parser)
    parser.add_argument("--which", choices=WHICH, help="checkpoint of a run directory (default: last)")
    parser.add_argument("--use-ema", action="store_true", help="timm's checkpoint: its EMA's weights (state_dict_ema)")
    return parser


def _predict(argv: list[str] | None, families: Families | None) -> int:
    args = build_parser().parse_args(argv)
    # imported after parsing: `convbias-predict --help` loads no torch or model family
    from convbias.engine import in_timm_output
    from convbias.sharing.prediction import (
        find_images,
        format_predictions,
        load_predictor,
        output_format,
        predict,
        source_kind,
        write_predictions,
    )

    source_kind(*in_timm_output(args.source, args.which), args.use_ema)
    suffix = output_format(args.output)
    device = args.device or default_device()
    paths = find_images(args.images)
    predictor = load_predictor(args.source, families or load_families(), args.which, args.use_ema)
    print(f"input: {predictor.expects()}", file=sys.stderr)
    for note in predictor.notes:
        print(f"warning: {note}", file=sys.stderr)

    def skipped(path: str, reason: str) -> None:
        print(f"skipping unreadable image {path} ({reason})", file=sys.stderr)

    result = predict(predictor, paths, args.topk, args.batch_size, device, on_skip=skipped)
    if not result.predictions:
        raise ConfigError(f"none of the {len(paths)} images could be read (skipped {len(paths)} unreadable images)")
    if args.output:
        write_predictions(result, predictor, args.topk, args.output)
        print(f"{len(result.predictions)} images labelled by {predictor.source} -> {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(format_predictions(result, predictor, args.topk, suffix))
    if result.skipped:
        print(f"skipped {len(result.skipped)} unreadable images", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
