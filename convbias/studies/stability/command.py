"""Relative stability to diffeomorphisms R_f of trained runs, per layer and against test error.

    convbias-stability runs/cnn runs/convit runs/fcn --checkpoints init best --images 500 \\
        --deltas 0.5 0.75 1 1.5 --cuts 3 5 --draws 10 --output stability/

Each RUN is a train.py output folder (see convbias.studies.stability.study). Writes OUTPUT/stability.csv
(one row per run, checkpoint, delta, c: test error, D_f, G_f, R_f with their standard errors over --draws
draws), stability_layers.csv, stability.md (per run, at --main-delta and the first cut), summary.csv and
summary.md (per group of runs that differ by seed: n, geometric mean of R_f over seeds and its 95% interval,
per layer in summary_layers.csv; contrasts.csv: R_f trained / first checkpoint per group, and against the
vanilla CNN group, which is not compared with itself),
rf_vs_delta.png, rf_per_layer.png, rf_vs_error.png (with the eps = 0.2 sqrt(R_f) line of Petrini et al. 2021)
and deformed_examples.png. Every table names its convention (--convention, --modes), images and draws.
With --combine DIR..., nothing is measured: the rows of earlier outputs (runs measured apart, in parallel or
as they finished training) are summarized together, and written with the same tables and figures (but
deformed_examples.png). What stops it is one `error: ...` line, before anything is written to OUTPUT: bad input
or a run without the checkpoint asked for (exit status 2), a damaged checkpoint (65); a failed write of
OUTPUT is one line too (74).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from convbias.base.command_line import OptionParser, Typed, add_device_option
from convbias.base.devices import default_device
from convbias.base.errors import ConfigError
from convbias.base.reporting import run_command
from convbias.base.run_layout import (
    INIT_SNAPSHOT,
    LAST_LINK,
    SNAPSHOT_NAME,
    STABILITY_FOLDER,
    STABILITY_LAYERS_TABLE,
    STABILITY_TABLE,
    SUMMARY_FILE,
)
from convbias.base.storage import check_output, output_folder, write_text
from convbias.base.tables import write_csv
from convbias.engine import POSITIVE_INT, WHICH, Check, declared
from convbias.evaluation import diffeo
from convbias.evaluation.stability import CONVENTIONS
from convbias.families import Families, load_families

from . import study
from .figures import plots

CONTRAST_REFERENCE = "vanilla_cnn"  # the group every other is compared with, at the same training fraction
CHECKPOINT = Check(lambda v: v in WHICH or SNAPSHOT_NAME.fullmatch(v) is not None, study.CHECKPOINT_FORMS)
# the diffeomorphism region of a displacement starts at 1/2 pixel (its end depends on c and the image's size,
# checked with the runs' images before any measurement); a cut-off c >= 2 (ln c > 0)
DISPLACEMENT = Check(lambda v: v >= 0.5, ">= 1/2 pixel (the diffeomorphism region starts there)")
CUT = Check(lambda v: v >= 2, ">= 2 (ln c > 0)")


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(
        prog="convbias-stability",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("runs", nargs="*", metavar="RUN", help="train.py output folders (config.yaml + checkpoints/)")
    p.add_argument(
        "--combine", nargs="+", default=[], metavar="DIR", help="summarize earlier outputs instead of measuring RUNs"
    )
    p.add_argument(
        "--checkpoints",
        nargs="+",
        type=Typed(str, CHECKPOINT),
        default=[INIT_SNAPSHOT, LAST_LINK],
        metavar="NAME",
        help=study.CHECKPOINT_FORMS,
    )
    p.add_argument(
        "--images", type=Typed(int, POSITIVE_INT), default=500, help="test images R_f is measured on (the first N)"
    )
    p.add_argument(
        "--deltas",
        type=Typed(float, DISPLACEMENT),
        nargs="+",
        default=[0.5, 0.75, 1.0, 1.5],
        help="typical displacements, pixels",
    )
    p.add_argument("--cuts", type=Typed(int, CUT), nargs="+", default=[3, 5], help="high-frequency cut-offs c")
    p.add_argument(
        "--main-delta",
        type=Typed(float, DISPLACEMENT),
        default=1.0,
        help="delta of the table, the per-layer curve and the error plot",
    )
    p.add_argument(
        "--convention",
        default="published",
        choices=tuple(CONVENTIONS),
        help="published: mean over images, per-image noise radius (the authors' code); robust: medians, one radius",
    )
    p.add_argument(
        "--modes",
        default="published",
        choices=diffeo.MODE_SETS,
        help="Fourier modes under the cut-off: published sqrt(i^2+j^2) < c+1/2, disc i^2+j^2 <= c^2",
    )
    p.add_argument(
        "--draws", type=Typed(int, POSITIVE_INT), default=10, help="diffeomorphism and noise draws per image"
    )
    p.add_argument("--normalize", action="store_true", help="divide D_f and G_f by <||f(x) - f(z)||^2> over test pairs")
    p.add_argument("--interpolation", default="bilinear", choices=diffeo.INTERPOLATIONS)
    p.add_argument("--chunk-size", type=Typed(int, POSITIVE_INT), default=64)
    p.add_argument("--seed", **declared("seed"), default=0, help="diffeomorphisms and noise")
    add_device_option(p)
    p.add_argument("--output", default="stability", help="output folder")
    return p


def parse_args(argv: list[str] | None) -> tuple[study.Settings, list[str], list[Path], Path]:
    args = build_parser().parse_args(argv)
    args.device = args.device or default_device()
    if bool(args.runs) == bool(args.combine):
        raise ConfigError("give either RUN folders to measure or --combine DIR... (earlier outputs), not both")
    fields = {k: getattr(args, k) for k in study.Settings.__dataclass_fields__}
    return study.Settings(**fields), args.runs, [Path(d) for d in args.combine], Path(args.output)


def main(argv: list[str] | None = None, families: Families | None = None) -> int:
    """``families``: the loaded families (``load_families()`` when not given), whose runs it measures."""
    return run_command(lambda: study_command(argv, families))


def study_command(argv: list[str] | None, families: Families | None) -> int:
    """The study: everything is read and checked (options, runs, datasets, weights, grid) before OUTPUT is
    created: bad input or a damaged checkpoint leaves no output behind."""
    settings, paths, combine, output = parse_args(argv)
    check_output(output, owned=STABILITY_FOLDER)  # before any run is read: a link among its files stops it first
    families = families or load_families()  # registers their models; a reparametrized run's is theirs
    runs = [study.load_run(Path(path), settings, families) for path in paths]
    if combine:
        rows = [r for d in combine for r in study.read_rows(d / STABILITY_TABLE)]
        layer_rows = [r for d in combine for r in study.read_rows(d / STABILITY_LAYERS_TABLE, study.LAYER_COLUMNS)]
        study.check_combinable(rows)
        first = rows[0]
        settings.convention, settings.modes, settings.images, settings.draws = (
            first["convention"],
            first["modes"],
            first["images"],
            first["draws"],
        )
        study.check_combined_settings(rows, settings)
    output_folder(output, owned=STABILITY_FOLDER)  # before measuring: an output that cannot be made stops it first
    if not combine:
        rows, layer_rows = study.measure(runs, settings)
    summary, layers = study.seed_summary(rows), study.layer_summary(layer_rows)
    main_point = (settings.main_delta, settings.cuts[0])
    before, after = settings.checkpoints[0], settings.checkpoints[-1]
    contrasts = study.contrasts(rows, *main_point, before, after, reference=CONTRAST_REFERENCE)
    tables = [
        write_csv(rows, output / STABILITY_TABLE, owner=output),
        write_csv(layer_rows, output / STABILITY_LAYERS_TABLE, owner=output),
        write_csv(summary, output / SUMMARY_FILE),
        write_csv(layers, output / "summary_layers.csv"),
        write_csv(contrasts, output / "contrasts.csv"),
    ]
    per_run = study.run_table(rows, settings)
    over_seeds = "\n\n".join(
        [study.summary_table(summary, delta, cut, settings.checkpoints) for delta, cut in settings.grid]
        + [study.layer_table(layers), study.contrast_table(contrasts)]
    )
    write_text(output / "stability.md", per_run)
    write_text(output / "summary.md", over_seeds)
    files = plots(rows, layer_rows, runs, settings, output)
    print(per_run + "\n" + over_seeds, end="")
    print("wrote " + ", ".join(map(str, [*tables, output / "stability.md", output / "summary.md", *files])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
