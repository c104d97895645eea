"""`convbias-ensemble RUN_DIR...`: the ensemble of train.py runs that differ by their seed.

    convbias-ensemble runs/convit_tiny-digits-seed0 runs/convit_tiny-digits-seed1 runs/convit_tiny-digits-seed2

Prints each member's validation error, the error of the averaged logits (or probabilities, with
--average probabilities) and the fluctuation sqrt(<||f_i - <f>||^2>) of the members around the average;
--output FILE.json also writes them. Members of different architectures, class counts, datasets or
output scales are refused with one `error: ...` line (exit status 2) before any model is built.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from convbias.engine import ConfigError, OptionParser
from convbias.evaluation.ensembles import AVERAGES, evaluate_runs
from convbias.families import load_families


def main(argv: list[str] | None = None) -> int:
    parser = OptionParser(prog="convbias-ensemble", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="train.py output directories (2 or more)")
    parser.add_argument("--average", choices=AVERAGES, default="logits", help="what the ensemble averages")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--output", help="also write the result to this JSON file")
    try:
        args = parser.parse_args(argv)
        for run in args.runs:
            if not Path(run).is_dir():
                raise ValueError(f"run directory not found: {run}")
        result = evaluate_runs(args.runs, load_families(), args.average, args.batch_size)
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    for run, error in zip(args.runs, result.member_errors):
        print(f"{run}: error {error:.2f}%")
    print(
        f"ensemble of {result.members} ({args.average} averaged): error {result.ensemble_error:.2f}% "
        f"(members: {result.mean_member_error:.2f}% on average), fluctuation {result.fluctuation:.4g}"
    )
    if args.output:
        Path(args.output).write_text(
            json.dumps({"runs": args.runs, "average": args.average, **result.as_dict()}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
