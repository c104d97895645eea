"""Paired contrasts and R_f trajectories of a relative-stability study, from its tables.

    convbias-stability-contrasts results/relative_stability --runs runs/relative_stability \\
        --convention published --modes published

FOLDER is a convbias-stability output (--combine of the study's runs). From FOLDER/stability.csv it writes
pairs.csv and pairs.md (the study's contrasts paired by seed, with 95% and Bonferroni intervals; see
convbias.studies.stability.contrasts). With --runs it reads R_f logged during training (train.py
--diagnostics) from every RUNS/*/log.jsonl into FOLDER/trajectories.csv; without, it reads an existing
FOLDER/trajectories.csv. Either way it writes trajectories_summary.csv and trajectories.png (the geometric
mean over seeds with its 95% interval). What stops it is one `error: ...` line: a missing table or bad option
(exit status 2), a damaged table, or a link or FIFO among FOLDER's files (65), a failed write (74).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from convbias.base.command_line import OptionParser
from convbias.base.reporting import run_command
from convbias.base.run_layout import STABILITY_FOLDER, STABILITY_TABLE, TRAJECTORIES_TABLE
from convbias.base.storage import check_output, output_folder
from convbias.base.tables import write_csv
from convbias.evaluation.diffeo import MODE_SETS
from convbias.evaluation.stability import CONVENTIONS

from . import contrasts
from .study import read_rows


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(
        prog="convbias-stability-contrasts",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("folder", type=Path, metavar="FOLDER", help="a convbias-stability output: reads and writes here")
    p.add_argument("--runs", type=Path, help="train.py output folders' parent: (re)write trajectories.csv from logs")
    p.add_argument(
        "--convention",
        default="published",
        choices=tuple(CONVENTIONS),
        help="the convention the training code logged R_f in",
    )
    p.add_argument(
        "--modes", default="published", choices=MODE_SETS, help="the mode set the training code logged R_f with"
    )
    p.add_argument("--no-figure", action="store_true", help="skip trajectories.png")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: contrasts_command(argv))


def contrasts_command(argv: list[str] | None) -> int:
    """Everything is read before anything is written, so bad input leaves FOLDER as it was."""
    args = build_parser().parse_args(argv)
    folder: Path = args.folder
    check_output(folder, "FOLDER", owned=STABILITY_FOLDER)
    rows = read_rows(folder / STABILITY_TABLE)
    if args.runs is not None:
        trajectories = contrasts.log_rows(args.runs, args.convention, args.modes)
    else:
        trajectories = contrasts.read_trajectories(folder / TRAJECTORIES_TABLE)
    output_folder(folder, "FOLDER", owned=STABILITY_FOLDER)
    files, pairs = contrasts.write_pairs(rows, folder)
    if args.runs is not None:
        files.append(write_csv(trajectories, folder / TRAJECTORIES_TABLE, owner=folder))
    files += contrasts.write_trajectories(trajectories, folder, figure=not args.no_figure)
    print(pairs, end="")
    print("wrote " + ", ".join(map(str, files)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
