"""`convbias-phase-diagram`: the (width, alpha~) phase diagram; see convbias.studies.phase_diagram.study.

convbias-phase-diagram -c configs/phase_diagram/digits_pca10.yaml --output results/phase_diagram
convbias-phase-diagram --output results/phase_diagram --plot-only     # figures and report CSVs again
convbias-sweep report --csv results/phase_diagram/runs.csv --output results/phase_diagram  # the sweep report of the grid
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from convbias.base.command_line import OptionParser
from convbias.base.errors import ConfigError
from convbias.base.reporting import run_command
from convbias.base.run_layout import PHASE_DIAGRAM_FOLDER
from convbias.base.storage import check_output, output_folder

from .study import CELLS_CSV, PhaseDiagramConfig, plot, read_cells, report_tables, run, write_report_csvs


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(
        prog="convbias-phase-diagram",
        description="The (width, alpha~) phase diagram of FC nets on odd/even digits (Geiger, Petrini & Wyart 2021, Figs. 4-5).",
    )
    p.add_argument("-c", "--config", help="YAML with any PhaseDiagramConfig field (widths, alpha_tildes, seeds, ...)")
    p.add_argument("--output", required=True, help="directory for config.yaml, the CSVs and the figures")
    p.add_argument("--plot-only", action="store_true", help="redraw the figures and report CSVs from OUTPUT/cells.csv")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: _phase_diagram(argv))


def _phase_diagram(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    output = Path(args.output)
    check_output(output, owned=PHASE_DIAGRAM_FOLDER)  # it writes its own config.yaml there
    cfg = PhaseDiagramConfig.from_yaml(args.config) if args.config else PhaseDiagramConfig().validated()
    if args.plot_only and not os.path.lexists(output / CELLS_CSV):
        raise ConfigError(f"--plot-only: {output / CELLS_CSV} not found; run without --plot-only first")
    if not args.plot_only and os.path.lexists(output / CELLS_CSV):
        raise ConfigError(f"{output} already holds a phase diagram ({CELLS_CSV}); choose another --output")
    if args.plot_only:  # everything read back before anything is written
        cells, tables = read_cells(output / CELLS_CSV), report_tables(output)
        output_folder(output, owned=PHASE_DIAGRAM_FOLDER)  # marked as the phase diagram's, if it was not
    else:
        cells = run(cfg, output)
        tables = report_tables(output)
    for path in plot(cells, output) + write_report_csvs(output, tables):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
