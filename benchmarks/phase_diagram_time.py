"""Wall-clock and CPU time of the phase-diagram reproduction (convbias-phase-diagram) against its target.

Runs the grid in a fresh subprocess (OMP_NUM_THREADS=1, as the committed run) into a temporary
directory and prints one table row: wall time, CPU time (user + system of the child), the CPU share
the machine gave it, and wall / target. Target: the default grid in under 30 minutes on the 2-core CPU.

    python benchmarks/phase_diagram_time.py                                   # the committed grid
    python benchmarks/phase_diagram_time.py -c my_small_grid.yaml --target-min 5
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from convbias.base.tables import markdown_table

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-c", "--config", default=str(REPO / "configs" / "phase_diagram" / "digits_pca10.yaml"))
    p.add_argument("--target-min", type=float, default=30.0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "convbias.studies.phase_diagram.command",
                "-c",
                args.config,
                "--output",
                str(Path(out) / "grid"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        wall = time.perf_counter() - started
    if done.returncode != 0:
        print(done.stderr.strip().splitlines()[-1], file=sys.stderr)
        return 1
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    print(f"phase diagram, {Path(args.config).name}, OMP_NUM_THREADS=1")
    header = ("wall (min)", "CPU (min)", "CPU share", "target (min)", "wall / target")
    row = (
        f"{wall / 60:.1f}",
        f"{cpu / 60:.1f}",
        f"{cpu / wall:.0%}",
        f"{args.target_min:g}",
        f"{wall / 60 / args.target_min:.2f}",
    )
    print(markdown_table(header, [row]), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
