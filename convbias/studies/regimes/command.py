"""`convbias-regimes`: lazy or feature training, summarized over a sweep of ``--output-scale`` runs.

    convbias-sweep run configs/sweeps/digits_regimes.yaml --output runs/regimes
    convbias-regimes runs/regimes        # regimes.csv, regimes_seeds.csv, regimes.md, regimes.png there

What is measured: convbias.studies.regimes.study.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from convbias.base.command_line import OptionParser
from convbias.base.errors import ConfigError
from convbias.base.reporting import run_command
from convbias.base.run_layout import SWEEP_RUNS_TABLE
from convbias.families import Families, load_families

from .study import write


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(
        prog="convbias-regimes",
        description="Top-1, tangent-kernel change and local energy per output scale alpha of a convbias-sweep run.",
    )
    parser.add_argument("sweep_dir", help="a convbias-sweep output directory (runs.csv, runs/)")
    return parser


def main(argv: list[str] | None = None, families: Families | None = None) -> int:
    """``families``: the loaded families (``load_families()`` when not given), whose runs it measures."""
    return run_command(lambda: _regimes(Path(build_parser().parse_args(argv).sweep_dir), families))


def _regimes(sweep_dir: Path, families: Families | None) -> int:
    if not os.path.lexists(sweep_dir / SWEEP_RUNS_TABLE):
        raise ConfigError(f"{sweep_dir / SWEEP_RUNS_TABLE} not found; run the sweep first (convbias-sweep run ...)")
    written = write(sweep_dir, families or load_families())
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
