"""`convbias-ensemble RUN_DIR...`: the ensemble of train.py runs that differ by their seed.

    convbias-ensemble runs/convit_tiny-digits-seed0 runs/convit_tiny-digits-seed1 runs/convit_tiny-digits-seed2

Prints each member's validation error with the checkpoint it was scored with (--which best, the point each
run records as its best evaluation, or last, its final weights), the error of the averaged logits (or
probabilities, with --average probabilities) and the fluctuation sqrt(<||f_i - <f>||^2>) of the members
around the average; --output FILE.json also writes them. What stops it is one `error: ...` line, before any
model is built: members of different architectures, class counts, datasets or output scales, or a member
without that checkpoint (exit status 2), a member whose weights fail their manifest (65).
"""

from __future__ import annotations

import argparse
import json

from convbias.base.command_line import OptionParser
from convbias.base.reporting import run_command
from convbias.base.run_layout import check_destination
from convbias.base.storage import write_text
from convbias.engine import WHICH, declared
from convbias.evaluation.ensembles import AVERAGES, evaluate_runs
from convbias.families import Families, load_families


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(prog="convbias-ensemble", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="train.py output directories (2 or more)")
    parser.add_argument("--which", choices=WHICH, default="best", help="the checkpoint of every member")
    parser.add_argument("--average", choices=AVERAGES, default="logits", help="what the ensemble averages")
    parser.add_argument("--batch-size", **declared("batch_size"), default=256)
    parser.add_argument("--output", help="also write the result to this JSON file")
    return parser


def main(argv: list[str] | None = None, families: Families | None = None) -> int:
    """``families``: the loaded families (``load_families()`` when not given), whose runs it ensembles."""

    def body() -> int:
        args = build_parser().parse_args(argv)
        if args.output:
            check_destination(args.output)
        result = evaluate_runs(args.runs, families or load_families(), args.average, args.batch_size, args.which)
        for run, error, checkpoint in zip(args.runs, result.member_errors, result.checkpoints):
            print(f"{run}: error {error:.2f}% ({checkpoint.describe()})")
        print(
            f"ensemble of {result.members} ({args.average} averaged): error {result.ensemble_error:.2f}% "
            f"(members: {result.mean_member_error:.2f}% on average) on {result.images} validation images; "
            f"fluctuation {result.fluctuation:.4g} (RMS distance of a member's {args.average} to their average, "
            f"in {args.average} units)"
        )
        if args.output:
            record = {"runs": args.runs, "average": args.average, "which": args.which, **result.as_dict()}
            write_text(args.output, json.dumps(record, indent=2) + "\n")
        return 0

    return run_command(body)


if __name__ == "__main__":
    raise SystemExit(main())
