"""The sweep report's figures from the runs of a sweep CSV: sample efficiency against the train fraction (like
Fig. 7.2, left) and the parameter sweep as a heatmap or accuracy lines (like Fig. 7.9, left). Error bars are
95% t intervals of the means over seeds (none for a single run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from convbias.base.storage import save_figure
from convbias.evaluation.figures import dodged, error_bar_note

from ..intervals import ACCURACY_RANGE, error_bar, paired_gap, stat
from .runs import (
    Rows,
    column_values,
    compared_column,
    fraction_label,
    group_runs,
    metric_label,
    parameter_columns,
    select_runs,
    setting_title,
    train_fractions,
)


def plot_sample_efficiency(rows: Rows, baseline: str, path: Path, metric: str = "top1", title: str = "") -> Path:
    """Fig. 7.2 (left): accuracy against train fraction per model, and the paired gap over the baseline
    in points; error bars are 95% t intervals of the means (none for a single run)."""
    column = compared_column(rows)
    fractions = train_fractions(rows)
    fig = Figure(figsize=(9, 3.9))
    ax, gap_ax = fig.subplots(1, 2)
    counts, cut = [], False
    names = column_values(rows, column)
    others = [name for name in names if name != baseline]
    for i, name in enumerate(names):
        stats = [stat(select_runs(rows, **{column: name, "train_fraction": f}), metric) for f in fractions]
        xs = [f for f, s in zip(fractions, stats) if s is not None]
        counts += [s.n for s in stats if s]
        shown = [s for s in stats if s]
        cut = cut or any(s.cut for s in shown)
        ax.errorbar(
            dodged(xs, i, len(names), fractions, log=True),
            [s.mean for s in shown],
            yerr=np.array([s.error_bars() for s in shown]).T,
            marker="o",
            capsize=3,
            label=str(name),
            linestyle="--" if name == baseline else "-",
        )
        if name == baseline:
            continue
        gaps = [
            paired_gap(
                select_runs(rows, **{column: name, "train_fraction": f}),
                select_runs(rows, **{column: baseline, "train_fraction": f}),
                metric,
            )
            for f in xs
        ]
        gap_ax.errorbar(
            dodged(
                [f for f, g in zip(xs, gaps) if g is not None], others.index(name), len(others), fractions, log=True
            ),
            [g.mean for g in gaps if g is not None],
            yerr=[error_bar(g.half_width) for g in gaps if g is not None],
            marker="o",
            capsize=3,
            label=f"{name} - {baseline}",
        )
    for axis, series in ((ax, names), (gap_ax, others)):
        axis.set_xscale("log")
        axis.set_xticks(fractions, [fraction_label(f) for f in fractions])
        axis.minorticks_off()
        axis.set_xlabel("fraction of the training set" + (" (series shifted apart)" if len(series) > 1 else ""))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    ax.set_ylabel(f"{metric_label(metric)} accuracy (%)")
    within_accuracy(ax)
    gap_ax.axhline(0, color="black", linewidth=0.8)
    gap_ax.set_ylabel("gap, paired by seed (points)")
    note = error_bar_note(counts) + (", cut at 100%" if cut else "") + " (gap: of the per-seed differences)"
    fig.suptitle(f"{title or 'Sample efficiency'}\n{note}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def within_accuracy(ax: Any) -> None:
    """An accuracy axis ends at 100% at most (its error bars are cut there)."""
    low, high = ax.get_ylim()
    ax.set_ylim(max(low, ACCURACY_RANGE[0]), min(high, ACCURACY_RANGE[1]))


def _is_numeric(values: list[Any]) -> bool:
    return all(isinstance(v, (int, float)) for v in values)


def plot_parameter_sweep(rows: Rows, path: Path, metric: str = "top1") -> Path:
    """Fig. 7.9 (left): a heatmap of mean accuracy over two swept factors, else accuracy lines."""
    params = parameter_columns(rows)
    panels = group_runs(rows, [compared_column(rows), "train_fraction"])
    fig = Figure(figsize=(4.6 * len(panels), 3.8))
    axes = fig.subplots(1, len(panels), squeeze=False)
    counts, cut = [], False  # runs behind each error bar; whether 100% cut an interval
    for ax, (where, selected) in zip(axes[0], panels):
        shown = {k: v for k, v in where.items() if v is not None}  # None: a column the CSV lacks
        ax.set_title(setting_title(shown), fontsize=9)
        if len(params) == 2:
            x_col, y_col = params
            xs, ys = sorted(column_values(selected, x_col)), sorted(column_values(selected, y_col))
            grid = np.full((len(ys), len(xs)), np.nan)
            for i, y in enumerate(ys):
                for j, x in enumerate(xs):
                    cell = stat(select_runs(selected, **{x_col: x, y_col: y}), metric)
                    if cell is not None:
                        grid[i, j] = cell.mean
            image = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
            for i, j in zip(*np.nonzero(~np.isnan(grid))):
                ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", color="white", fontsize=8)
            ax.set_xticks(range(len(xs)), [f"{x:g}" if isinstance(x, float) else x for x in xs])
            ax.set_yticks(range(len(ys)), [f"{y:g}" if isinstance(y, float) else y for y in ys])
            ax.set_xlabel(x_col)
            ax.set_ylabel(y_col)
            fig.colorbar(image, ax=ax, label=f"{metric_label(metric)} accuracy (%)")
        else:
            x_col, rest = params[0], params[1:]
            lines = group_runs(selected, rest)
            for i, (line, line_rows) in enumerate(lines):
                xs = sorted(column_values(line_rows, x_col))
                stats = [stat(select_runs(line_rows, **{x_col: x}), metric) for x in xs]
                counts += [s.n for s in stats]
                cut = cut or any(s.cut for s in stats)
                positions = xs if _is_numeric(xs) else list(range(len(xs)))
                ax.errorbar(
                    dodged(positions, i, len(lines), positions),
                    [s.mean for s in stats],
                    yerr=np.array([s.error_bars() for s in stats]).T,
                    marker="o",
                    capsize=3,
                    label=setting_title(line) or None,
                )
                if not _is_numeric(xs):
                    ax.set_xticks(positions, [str(x) for x in xs])
            ax.set_xlabel(x_col)
            ax.set_ylabel(f"{metric_label(metric)} accuracy (%)")
            within_accuracy(ax)
            ax.grid(alpha=0.3)
            if rest:
                ax.legend(fontsize=7)
    if counts:
        fig.suptitle(error_bar_note(counts) + (", cut at 100%" if cut else ""), fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
