"""`convbias-efcn-protocol`: the eFCN relax-time protocol (Sec. 6.2.2); see convbias.studies.efcn_protocol.protocol.

convbias-efcn-protocol -c configs/efcn_protocol/efcn_cpu.yaml --output results/efcn
accelerate launch -m convbias.studies.efcn_protocol.command -c configs/efcn_protocol/efcn_cifar10.yaml --stage train --output runs/efcn
convbias-efcn-protocol --stage summarize --seed-dirs runs/efcn/seed0 runs/efcn/seed1 ... --output results/efcn
convbias-efcn-protocol --stage single-seed --test-images 359 --output results/efcn
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import yaml

from convbias.base.command_line import OptionParser, Typed
from convbias.base.errors import ConfigError
from convbias.base.reporting import run_command
from convbias.base.run_layout import EFCN_PROTOCOL_FOLDER, PROTOCOL_CONFIG
from convbias.base.storage import check_output, output_folder, write_text
from convbias.engine import POSITIVE_INT, declared
from convbias.families import Families, load_families

from .protocol import OPTIMIZERS, SNAPSHOTS, analyze_stage, load_config, protocol_stages, train_stage
from .seeds import single_seed_intervals, summarize_seeds


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(prog="convbias-efcn-protocol", description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", help="protocol YAML (configs/efcn_protocol/*.yaml)")
    parser.add_argument("--output", required=True, help="directory for the runs, CSVs and figures")
    parser.add_argument("--stage", choices=("all", "train", "analyze", "summarize", "single-seed"), default="all")
    parser.add_argument(
        "--seed-dirs", nargs="+", default=[], metavar="DIR", help="summarize: protocol outputs, one per seed"
    )
    parser.add_argument(
        "--test-images",
        type=Typed(int, POSITIVE_INT),
        help="single-seed: the test images the accuracies were measured on",
    )
    parser.add_argument("--cnn-epochs", type=Typed(int, POSITIVE_INT), dest="cnn_epochs")
    parser.add_argument("--efcn-epochs", type=Typed(int, POSITIVE_INT), dest="efcn_epochs")
    parser.add_argument("--snapshots", type=Typed(int, SNAPSHOTS), dest="snapshots")
    parser.add_argument("--workers", **declared("workers"), dest="workers")
    parser.add_argument("--seed", **declared("seed"), dest="seed")
    parser.add_argument("--optimizer", choices=OPTIMIZERS)
    parser.add_argument("--data-dir", dest="data_dir", help="dataset folder (CIFAR, ImageNet, ...)")
    return parser


def main(argv: list[str] | None = None, families: Families | None = None) -> int:
    """``families``: the loaded families (``load_families()`` when not given): the eFCN's models and tools."""
    started = time.perf_counter()
    return run_command(lambda: _protocol(build_parser().parse_args(argv), started, families))


def _protocol(args: argparse.Namespace, started: float, families: Families | None) -> int:
    if args.stage == "summarize":
        if len(args.seed_dirs) < 2:
            raise ConfigError(f"--stage summarize needs --seed-dirs with at least 2 directories, got {args.seed_dirs}")
        files = summarize_seeds([Path(d) for d in args.seed_dirs], Path(args.output))
        print(f"[efcn_protocol] wrote {', '.join(map(str, files))}")
        return 0
    if args.stage == "single-seed":
        if args.test_images is None:
            raise ConfigError("--stage single-seed needs --test-images N (a positive count)")
        files = single_seed_intervals(Path(args.output), args.test_images)
        print(f"[efcn_protocol] wrote {', '.join(map(str, files))}")
        return 0
    check_output(args.output, owned=EFCN_PROTOCOL_FOLDER)  # before the config is read and the families loaded
    families = families or load_families()  # registers the models the config names, gives the eFCN's tools
    cfg = load_config(
        args.config,
        {
            k: getattr(args, k)
            for k in ("cnn_epochs", "efcn_epochs", "snapshots", "workers", "seed", "optimizer", "data_dir")
        },
    )
    out = output_folder(args.output, owned=EFCN_PROTOCOL_FOLDER)
    write_text(out / PROTOCOL_CONFIG, yaml.safe_dump(cfg, sort_keys=False), owner=out)
    analyze = args.stage in ("all", "analyze") and int(os.environ.get("RANK", "0")) == 0
    progress = protocol_stages(cfg, train=args.stage in ("all", "train"), analyze=analyze)
    if args.stage in ("all", "train"):
        train_stage(cfg, out, families, progress)
    if analyze:
        analyze_stage(cfg, out, families, progress)
    print(f"[efcn_protocol] done in {(time.perf_counter() - started) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
