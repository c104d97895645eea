"""Sweep report from the CSV alone: markdown tables like Tables 7.2/7.3 and plots like Figs. 7.2/7.9.

The CSV has one row per run (written by ``convbias.studies.sweep.sweep``). Its columns are the grid factors
(``variant`` or ``model``, ``train_fraction``, any swept option such as ``locality_strength``), the
replicate ``seed`` and the results (``top1``, ``top5``, ``best_top1``, ...). Runs that differ only by
seed are aggregated as mean ± std [95% confidence interval of the mean] and their number n (sample std,
n-1; Student's t interval; one run has no interval and says so).

- Two or more compared models (``variant``, else ``model``) over train fractions: per fraction, the gap
  of each model over the baseline in points, paired by seed (a seed fixes the init and the training
  subset): the mean of the per-seed differences with its 95% t interval; the relative gap of the means,
  (mean - baseline mean) / baseline mean, as in Table 7.2 (two models) or Table 7.3 (more); whether the
  gap changes between the smallest and the largest fraction (difference of the gaps, Welch interval);
  and the plot of Fig. 7.2 (left).
- Other swept factors (parameter sweeps): one row per setting, and a heatmap (two numeric factors,
  like Fig. 7.9 left) or a line plot (one factor).

The runs are read and grouped by ``runs``, the plots drawn by ``figures``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from convbias.base.errors import ConfigError
from convbias.base.run_layout import REPORT_FILE, SWEEP_FOLDER
from convbias.base.storage import output_folder, write_text
from convbias.base.tables import markdown_table

from ..intervals import (
    ACCURACY_NOTE,
    ACCURACY_RANGE,
    CONFIDENCE,
    Stat,
    gap_change,
    mean_gap,
    paired_gap,
    per_seed_gaps,
    proportion_interval,
    stat,
)
from .figures import plot_parameter_sweep, plot_sample_efficiency
from .runs import (
    ENSEMBLE_COLUMNS,
    Rows,
    choose_baseline,
    column_values,
    compared_column,
    fraction_label,
    group_runs,
    metric_label,
    parameter_columns,
    read_runs,
    read_runs_like,
    select_runs,
    setting_title,
    train_fractions,
)
from .sweep import ENSEMBLES_CSV_NAME

REPORT_NAME = REPORT_FILE


def _gap(value: Stat | None, base: Stat | None) -> str:
    if value is None or base is None or base.mean == 0:
        return "–"
    percent = round(100 * (value.mean - base.mean) / base.mean)
    return f"{percent:+d}%" if percent else "0%"


def _markdown(header: Sequence[str], body: list[Sequence[Any]]) -> str:
    return markdown_table(header, body).rstrip("\n")


def _count(rows: Rows, metric: str) -> int:
    return sum(metric in row for row in rows)


def _counts(counts: list[int]) -> str:
    """'5', or '2-5' when cells have different numbers of runs."""
    low, high = min(counts, default=0), max(counts, default=0)
    return str(low) if low == high else f"{low}-{high}"


def comparison_table(rows: Rows, baseline: str, metric: str = "top1") -> str:
    """Table 7.2 (two models: rows are fractions) or Table 7.3 (more: rows are models).

    Cells: mean ± std [95% interval of the mean]; gaps: model - baseline in points, paired by seed,
    [95% interval]; relative gaps from the means; n: runs per cell."""
    column = compared_column(rows)
    others = [name for name in column_values(rows, column) if name != baseline]
    fractions = train_fractions(rows)
    top5 = metric.replace("top1", "top5")
    if len(others) == 1:
        other = others[0]
        header = ["Train size", "n"]
        for k in ("top-1", "top-5"):
            header += [f"{baseline} {k}", f"{other} {k}", f"gap {k} (points)", "relative"]
        body = []
        for f in fractions:
            base_rows = select_runs(rows, **{column: baseline, "train_fraction": f})
            other_rows = select_runs(rows, **{column: other, "train_fraction": f})
            cells = [fraction_label(f), _counts([_count(base_rows, metric), _count(other_rows, metric)])]
            for m in (metric, top5):
                base, value = stat(base_rows, m), stat(other_rows, m)
                cells += [base or "–", value or "–", paired_gap(other_rows, base_rows, m) or "–", _gap(value, base)]
            body.append(cells)
        return _markdown(header, body)
    header = [column, "n"] + [f"{fraction_label(f)} top-{k} (gap, points)" for f in fractions for k in (1, 5)]
    body = []
    for name in column_values(rows, column):
        cells, counts = [], []
        for f in fractions:
            base_rows = select_runs(rows, **{column: baseline, "train_fraction": f})
            name_rows = select_runs(rows, **{column: name, "train_fraction": f})
            counts.append(_count(name_rows, metric))
            for m in (metric, top5):
                value = stat(name_rows, m)
                gap = paired_gap(name_rows, base_rows, m)
                cells.append("–" if value is None else str(value) if name == baseline else f"{value} ({gap or '–'})")
        body.append([name, _counts(counts)] + cells)
    return _markdown(header, body)


def trend_lines(rows: Rows, baseline: str, metric: str = "top1") -> list[str]:
    """Per compared model: its paired gap at each fraction, whether each interval excludes 0, and whether
    the gap differs between the smallest and the largest fraction (Welch interval of the difference)."""
    column = compared_column(rows)
    fractions = train_fractions(rows)
    lines = []
    for name in column_values(rows, column):
        if name == baseline:
            continue
        gaps = {}
        for f in fractions:
            base_rows = select_runs(rows, **{column: baseline, "train_fraction": f})
            gaps[f] = per_seed_gaps(select_runs(rows, **{column: name, "train_fraction": f}), base_rows, metric)
        per_fraction = []
        for f, diffs in gaps.items():
            gap = mean_gap(diffs)
            if gap is not None and math.isnan(gap.half_width):
                per_fraction.append(f"{fraction_label(f)}: {gap}")
            elif gap is not None:
                verdict = "interval excludes 0" if gap.excludes_zero else "interval includes 0"
                per_fraction.append(f"{fraction_label(f)}: {gap} ({verdict})")
        line = f"- {name} - {baseline}, {metric_label(metric)} in points: " + "; ".join(per_fraction) + "."
        if len(fractions) > 1:
            small, large = fractions[0], fractions[-1]
            change = gap_change(gaps[large], gaps[small])
            span = f" Gap at {fraction_label(small)} minus gap at {fraction_label(large)}"
            if change is None:
                line += f"{span}: too few runs for an interval."
            else:
                verdict = (
                    "the gap differs between the two fractions"
                    if change.excludes_zero
                    else "no change of the gap is supported"
                )
                line += f"{span}: {change} ({verdict})."
        lines.append(line)
    return lines


def parameter_table(rows: Rows, metric: str = "top1") -> str:
    """One row per setting of the swept factors: top-1 and top-5 as mean ± std [95% interval], n runs."""
    factors = [compared_column(rows), "train_fraction"] + parameter_columns(rows)
    top5 = metric.replace("top1", "top5")
    body = []
    for setting in dict.fromkeys(tuple(row.get(f) for f in factors) for row in rows):
        selected = select_runs(rows, **dict(zip(factors, setting)))
        body.append(list(setting) + [stat(selected, metric) or "–", stat(selected, top5) or "–", len(selected)])
    return _markdown(factors + ["top-1", "top-5", "n"], body)


ENSEMBLE_METRICS = ("members", "ensemble_top1", "member_top1", "fluctuation")
ENSEMBLE_SPREAD = ("member_top1_std", "images")  # the intervals' inputs, in sweeps that recorded them


def read_ensembles(path: str | Path) -> Rows:
    """ensembles.csv (written by the sweep when a grid has several seeds): one row per group of runs, its
    columns as declared (``runs.ENSEMBLE_COLUMNS``)."""
    return read_runs_like(path, "sweep ensembles table", ENSEMBLE_COLUMNS, ENSEMBLE_METRICS)


def ensemble_table(rows: Rows) -> str:
    """One row per group: its factors, the top-1 of the averaged logits with its Clopper-Pearson interval
    over the validation images, the members' mean top-1 ± std [t interval over the members], the gain of
    ensembling (points of top-1) and the fluctuation of the members around their average. Rows without
    the spread columns (older sweeps) say "no interval"."""
    factors = [column for column in rows[0] if column not in (*ENSEMBLE_METRICS, *ENSEMBLE_SPREAD)]

    def ensemble_cell(row: dict[str, Any]) -> str:
        if "images" not in row:
            return f"{row['ensemble_top1']:.1f} (no interval)"
        images = int(row["images"])
        low, high = proportion_interval(round(row["ensemble_top1"] * images / 100), images)
        return f"{row['ensemble_top1']:.1f} [{low:.1f}, {high:.1f}]"

    def member_cell(row: dict[str, Any]) -> str:
        if "member_top1_std" not in row:
            return f"{row['member_top1']:.1f} (no interval)"
        return str(Stat(row["member_top1"], row["member_top1_std"], int(row["members"]), ACCURACY_RANGE))

    body = [
        [row.get(f, "–") for f in factors]
        + [
            ensemble_cell(row),
            member_cell(row),
            f"{row['ensemble_top1'] - row['member_top1']:+.1f}",
            f"{row['fluctuation']:.3g}",
            row["members"],
        ]
        for row in rows
    ]
    return _markdown(factors + ["ensemble top-1", "members top-1 (mean)", "gain", "fluctuation", "members"], body)


def ensembles_beside(csv_path: str | Path) -> Path | None:
    """The sweep's ensembles.csv beside its runs CSV, when there is one: what a report includes by default."""
    path = Path(csv_path).parent / ENSEMBLES_CSV_NAME
    return path if os.path.lexists(path) else None  # whatever is there is read (and refused) as the table


def write_report(
    csv_path: str | Path,
    out_dir: str | Path | None = None,
    baseline: str | None = None,
    best: bool = False,
    ensembles: str | Path | None = None,
) -> list[Path]:
    """Write ``report.md`` and the PNGs next to the CSV (or in ``out_dir``); return the paths. ``ensembles``
    (an ensembles.csv, e.g. ``ensembles_beside(csv_path)``) adds the table of ensembles over seeds."""
    rows = read_runs(csv_path)
    ensemble_rows = read_ensembles(ensembles) if ensembles is not None else None  # every table read before writing
    out_dir = output_folder(out_dir if out_dir is not None else Path(csv_path).parent, writer=SWEEP_FOLDER.owner)
    metric = "best_top1" if best else "top1"
    if best and metric not in rows[0]:
        raise ConfigError(f"{csv_path} has no best_top1 column")
    column = compared_column(rows)
    params = parameter_columns(rows)
    written = []
    which = "best" if best else "final"
    sections = [
        f"# Sweep report\n\nFrom `{Path(csv_path).name}`: {len(rows)} runs, {which} accuracy. A cell is "
        f"mean ± std [{CONFIDENCE:.0%} t interval of the mean] over its n runs (seeds); {ACCURACY_NOTE}."
    ]
    compared = len(column_values(rows, column)) > 1
    if compared:
        base = choose_baseline(rows, baseline)
        for where, selected in group_runs(rows, params):
            suffix = "" if not where else "_" + "_".join(f"{k}-{v}" for k, v in where.items())
            heading = f"## Sample efficiency{' (' + setting_title(where) + ')' if where else ''}"
            sections.append(
                f"{heading}\n\nGap: model - {base} in points, the mean of the per-seed differences (a seed fixes "
                f"the init and the training subset) [{CONFIDENCE:.0%} paired t interval]; relative: "
                f"(mean - {base} mean) / {base} mean.\n\n"
                + comparison_table(selected, base, metric)
                + "\n\n"
                + "\n".join(trend_lines(selected, base, metric))
            )
            if len(train_fractions(selected)) > 1:
                png = plot_sample_efficiency(
                    selected, base, out_dir / f"sample_efficiency{suffix}.png", metric, setting_title(where)
                )
                sections.append(f"![sample efficiency]({png.name})")
                written.append(png)
    if not compared and not params:  # one model: its accuracy per fraction
        sections.append("## Results\n\n" + parameter_table(rows, metric))
    if params:
        sections.append("## Parameter sweep\n\n" + parameter_table(rows, metric))
        png = plot_parameter_sweep(rows, out_dir / "parameter_sweep.png", metric)
        sections.append(f"![parameter sweep]({png.name})")
        written.append(png)
    if ensembles is not None:
        sections.append(
            "## Ensembles over seeds\n\nOne ensemble per group (its members are the group's n runs, each at "
            "the checkpoint its study evaluates: a sweep's best, a phase diagram's last): the ensemble's top-1 "
            "has no replicate over seeds, so its interval is the "
            f"{CONFIDENCE:.0%} Clopper-Pearson interval over the validation images (test-set sampling only); "
            f"the members' top-1 is mean ± std [{CONFIDENCE:.0%} t interval over the members].\n\n"
            + ensemble_table(ensemble_rows)
        )
    report = out_dir / REPORT_NAME
    write_text(report, "\n\n".join(sections) + "\n")
    return [report] + written
