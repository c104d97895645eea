"""Sample-efficiency and parameter sweeps over train.py, and their report (Table 7.2, Figs. 7.2/7.9).

    # run a sweep file (every incomplete run, one train.py subprocess at a time), then report
    convbias-sweep run configs/sweeps/digits_sample_efficiency.yaml --output results/sample_efficiency
    # the same grid on your own ImageFolder
    convbias-sweep run configs/sweeps/digits_sample_efficiency.yaml --output out/mine \\
        --dataset folder --data-dir /data/my_images --set img_size=32 model_kwargs.patch_size=4
    # print the train.py commands instead, for a cluster scheduler; collect when they are done
    convbias-sweep run configs/sweeps/imagenet_sample_efficiency.yaml --output out/se \\
        --data-dir /data/imagenet --launcher "accelerate launch --multi_gpu --num_processes 8" --print-commands
    convbias-sweep collect --output out/se
    # regenerate the tables and plots from the CSV alone
    convbias-sweep report --csv results/sample_efficiency/runs.csv --output out/report

Without a sweep file the grid is convit_tiny vs deit_tiny_patch16_224 at f in {0.05, 0.1, 0.3, 0.5, 1}
(epochs x 1/f), seed 0, with train.py's defaults (the DeiT recipe; pick the data with --dataset,
--data-dir or --config). ``--models``, ``--fractions``, ``--seeds``, ``--grid KEY=V1,V2`` and
``--set KEY=VALUE`` change any axis or shared option (``model_kwargs.NAME`` for a model argument).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convbias.base.command_line import OptionParser, Typed, yaml_scalar
from convbias.base.errors import ConfigError
from convbias.base.reporting import run_command
from convbias.engine import FRACTION, Interrupted, declared
from convbias.families import Families, load_families

from . import spec as sweep_spec

if TYPE_CHECKING:
    from .sweep import Sweep

DEFAULT_GRID = {
    "model": ["convit_tiny", "deit_tiny_patch16_224"],
    "train_fraction": [0.05, 0.1, 0.3, 0.5, 1.0],
    "seed": [0],
}


def _key_value(text: str) -> tuple[str, str]:
    """--set and --grid items: KEY=TEXT with the text kept raw (a grid splits it at commas first)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got '{text}'")
    return key.replace("-", "_") if not key.startswith("model_kwargs.") else key, value


def _parse_value(text: str) -> Any:
    """One value as train.py's K=V options read it (YAML scalars; 'none' is None)."""
    return yaml_scalar(text) if text != "" else ""


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run (or print) every incomplete run of a grid, then report")
    run.add_argument("sweep", nargs="?", help="sweep YAML (configs/sweeps/*.yaml); default: ConViT vs DeiT grid")
    run.add_argument("--output", required=True, help="sweep directory (runs/, logs/, sweep.yaml, runs.csv, report)")
    run.add_argument("--models", nargs="+", help="grid axis: model names")
    run.add_argument("--fractions", nargs="+", type=Typed(float, FRACTION), help="grid axis: train fractions in (0, 1]")
    run.add_argument("--seeds", nargs="+", **declared("seed"), help="grid axis: seeds")
    run.add_argument(
        "--grid",
        nargs="+",
        type=_key_value,
        default=[],
        metavar="KEY=V1,V2",
        help="grid axis for any train.py option or model_kwargs.NAME",
    )
    run.add_argument(
        "--set",
        nargs="+",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="train.py option shared by every run (model_kwargs.NAME for a model argument)",
    )
    run.add_argument("--dataset", help="shorthand for --set dataset=NAME")
    run.add_argument("--data-dir", help="shorthand for --set data_dir=PATH")
    run.add_argument("--config", help="base train.py recipe YAML passed to every run (-c)")
    run.add_argument("--no-scale-epochs", action="store_true", help="keep the epochs fixed across fractions")
    run.add_argument(
        "--launcher",
        default=None,
        help='command that launches train.py, e.g. "accelerate launch --num_processes 8" (default: this python)',
    )
    run.add_argument(
        "--print-commands",
        action="store_true",
        help="print the train.py command of every incomplete run instead of running it",
    )
    _add_report_options(run)

    collect = commands.add_parser("collect", help="write runs.csv and the report from the complete runs")
    collect.add_argument("--output", required=True, help="sweep directory (holding sweep.yaml)")
    _add_report_options(collect)

    report = commands.add_parser("report", help="regenerate the tables and plots from a runs CSV")
    report.add_argument("--csv", required=True, help="runs.csv written by run/collect")
    report.add_argument(
        "--output", required=True, help="directory for report.md and PNGs (a committed results/ folder only by name)"
    )
    report.add_argument(
        "--ensembles",
        metavar="CSV",
        help="ensembles.csv whose table the report adds (default: the one beside --csv, if any; none: no table)",
    )
    _add_report_options(report)
    return parser


def _add_report_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baseline",
        help="model (or variant) the gaps are relative to (default: the sweep's "
        "baseline, else the only name containing 'deit')",
    )
    parser.add_argument("--best", action="store_true", help="report the best epoch instead of the final one")


def spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    spec = sweep_spec.load_spec(args.sweep) if args.sweep else sweep_spec.normalize_spec({"grid": DEFAULT_GRID})
    grid = {key: [_parse_value(v) for v in value.split(",")] for key, value in args.grid}
    for key, values in (("model", args.models), ("train_fraction", args.fractions), ("seed", args.seeds)):
        if values:
            grid[key] = values
    options = {key: _parse_value(value) for key, value in args.set}
    if args.dataset:
        options["dataset"] = args.dataset
    if args.data_dir:
        options["data_dir"] = args.data_dir
    spec = sweep_spec.override_spec(spec, grid, options)
    if args.config:
        spec["config"] = args.config
    if args.no_scale_epochs:
        spec["scale_epochs"] = False
    return spec


def write_outputs(prepared: Sweep, args: argparse.Namespace, families: Families) -> int:
    """runs.csv and the report from the complete runs (their ensembles built with the loaded ``families``); 1 if
    some runs are missing."""
    from . import report, sweep  # not at the top: `--help` loads no torch or timm

    rows, missing = prepared.collect()
    if missing:
        print(f"{len(missing)} of {len(prepared.runs)} runs are not complete: {'; '.join(missing)}")
    if not rows:
        return 1
    csv_path = sweep.write_csv(rows, prepared.sweep_dir / sweep.CSV_NAME, owner=prepared.sweep_dir)
    written = [csv_path]
    if len({row["seed"] for row in rows}) > 1:  # several seeds: ensemble columns in the report
        ensembles = prepared.collect_ensembles(rows, families)
        if ensembles:
            path = prepared.sweep_dir / sweep.ENSEMBLES_CSV_NAME
            written.append(sweep.write_csv(ensembles, path, owner=prepared.sweep_dir))
    ensembles = report.ensembles_beside(csv_path)
    paths = report.write_report(
        csv_path, baseline=args.baseline or prepared.spec["baseline"], best=args.best, ensembles=ensembles
    )
    _print_written(written + paths)
    return 1 if missing else 0


def _print_written(paths: list[Path]) -> None:
    print("wrote " + ", ".join(str(p) for p in paths))


def main(argv: list[str] | None = None, families: Families | None = None) -> int:
    """``families``: the loaded families (``load_families()`` when not given): the runs' models are checked
    against the registry they fill, and the ensembles built with them."""
    return run_command(lambda: _sweep(build_parser().parse_args(argv), families))


def _sweep(args: argparse.Namespace, families: Families | None) -> int:
    from . import report, sweep  # not at the top: `--help` loads no torch or timm

    if args.command == "report":
        ensembles = None if args.ensembles == "none" else args.ensembles or report.ensembles_beside(args.csv)
        if ensembles is not None:
            print(f"ensembles over seeds: {ensembles}")  # a file the CSV does not name: say which one
        _print_written(report.write_report(args.csv, args.output, args.baseline, args.best, ensembles))
        return 0
    families = families or load_families()  # registers their models: each run's model is checked against them
    if args.command == "collect":
        record = Path(args.output) / sweep.RECORD_NAME
        if not os.path.lexists(record):
            raise ConfigError(f"{record} not found: is {args.output} a sweep directory?")
        prepared = sweep.Sweep.prepare(sweep.read_record(Path(args.output)), args.output)
        return write_outputs(prepared, args, families)
    prepared = sweep.Sweep.prepare(spec_from_args(args), args.output)
    launcher = shlex.split(args.launcher) if args.launcher else None
    if args.print_commands:
        for cmd in prepared.commands(launcher):
            print(shlex.join(cmd))
        return 0
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's SIGTERM stops the child too
    try:
        failed = prepared.execute(launcher)
    except KeyboardInterrupt:
        raise Interrupted("rerun the same command to resume (complete runs are kept)") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    status = write_outputs(prepared, args, families)
    if failed:
        print(f"{len(failed)} run(s) failed, left as they are: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else status


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main())
