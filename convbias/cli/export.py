"""`convbias-export RUN_DIR --output DIR`: a train.py run (or timm's checkpoint) as a folder timm loads, with a card.

    convbias-export runs/tcnn_resnet18-digits --output exported/tcnn_resnet18-digits --which best
    python -c "import timm, transformed_cnn; timm.create_model('local-dir:exported/tcnn_resnet18-digits', pretrained=True)"

RUN_DIR may also be timm's train.py checkpoint (last.pth.tar, model_best.pth.tar): its model is built from the
arguments saved in it, as timm's validate.py builds it (--use-ema for its EMA's weights), and its args.yaml is
written beside the card. Writes timm's Hub format (model.safetensors, config.json with the model's arguments and the run's
preprocessing), a README.md model card (front matter, architecture, recipe, results, usage, version),
the run's config.yaml and results.json. --onnx adds model.onnx (the `onnx` extra) and --pt2 a
torch.export program, each checked against the PyTorch model; --push-to USER/REPO uploads the folder
with huggingface_hub. What stops it is one `error: ...` line: bad input (exit status 2) and a damaged
checkpoint or results.json of the run (65) before anything is written, a write that fails (disk full, 74)
with nothing left at --output; a failed upload (1) leaves the folder in place.
"""

from __future__ import annotations

import argparse

from convbias.base.command_line import OptionParser, Typed
from convbias.base.errors import ConfigError, print_error
from convbias.base.run_layout import check_output_folder
from convbias.cli import run_command
from convbias.engine import POSITIVE_INT, WHICH, in_timm_output, is_timm_checkpoint_name
from convbias.families import Families, load_families


def main(argv: list[str] | None = None, families: Families | None = None) -> int:
    """``families``: the loaded families (``load_families()`` when not given), whose models it exports."""
    return run_command(lambda: _export(argv, families))


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(prog="convbias-export", description=__doc__.split("\n")[0])
    parser.add_argument("run", metavar="RUN_DIR", help="a train.py output directory, or timm's *.pth.tar")
    parser.add_argument("--output", required=True, help="new folder to write (must not exist, or be empty)")
    parser.add_argument("--which", choices=WHICH, help="the checkpoint of a run to export (default: last)")
    parser.add_argument("--use-ema", action="store_true", help="timm's checkpoint: its EMA's weights (state_dict_ema)")
    parser.add_argument("--onnx", action="store_true", help="also write model.onnx (needs the onnx extra)")
    parser.add_argument("--pt2", action="store_true", help="also write model.pt2 (torch.export)")
    parser.add_argument(
        "--img-size", type=Typed(int, POSITIVE_INT), help="input side of model.onnx / model.pt2 (default: the run's)"
    )
    parser.add_argument("--license", default="apache-2.0", help="license of the weights, in the card")
    parser.add_argument("--push-to", metavar="REPO_ID", help="upload the folder to this Hub repository")
    parser.add_argument("--private", action="store_true", help="with --push-to: create a private repository")
    return parser


def _export(argv: list[str] | None, families: Families | None) -> int:
    args = build_parser().parse_args(argv)
    check_output_folder(args.output)  # a folder in a run's checkpoints/ would be taken for a point's
    args.run, args.which = in_timm_output(args.run, args.which)  # timm's output folder: its file by --which
    timm_file = is_timm_checkpoint_name(args.run)
    if timm_file and args.which:
        raise ConfigError(f"--which is for run directories; {args.run} is timm's checkpoint (--use-ema for its EMA)")
    if args.use_ema and not timm_file:
        raise ConfigError(
            f"--use-ema picks the EMA weights of timm's checkpoint file (*.pth.tar); {args.run} is not one"
        )
    # imported after parsing: `convbias-export --help` loads no timm, Hub client or model family
    from convbias.sharing.hub import export_run, export_timm_checkpoint, push_folder

    families = families or load_families()  # registers the families' models
    deploy = tuple(name for name, wanted in (("onnx", args.onnx), ("pt2", args.pt2)) if wanted)
    if timm_file:
        done = export_timm_checkpoint(
            args.run, args.output, families, args.use_ema, deploy, args.img_size, args.license, args.push_to
        )
    else:
        done = export_run(
            args.run, args.output, families, args.which or "last", deploy, args.img_size, args.license, args.push_to
        )
    top1 = done["metrics"].get("top1")
    print(
        f"{done['checkpoint']} -> {done['output']} ({done['model']}"
        + (f", top-1 {top1:.2f}" if top1 is not None else "")
        + ")"
    )
    for name, error in done["checks"].items():
        print(f"model.{name}: relative error against PyTorch {error:.1e}")
    if args.push_to:
        try:
            url = push_folder(done["output"], args.push_to, private=args.private)
        except ConfigError as error:  # the folder is written: exit 1, not a refusal's 2
            print_error(str(error))
            return 1
        print(f"uploaded to {url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
