"""Figures of `convbias-stability`: R_f against delta, per layer, against the test error, and deformed examples.
Runs that differ only by seed are averaged geometrically, as in Petrini et al. 2021; the error bars are the
95% intervals of the summary tables (`seed_summary`, `layer_summary`), so a figure and its table agree."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from convbias.base.storage import save_figure
from convbias.evaluation import diffeo
from convbias.evaluation.figures import (
    displayable,
    dodged,
    error_bar_note,
    log_ticks,
    qualitative_colors,
    shared_legend,
)

from ..intervals import error_bar
from .study import Run, Settings, layer_summary, seed_summary

ERROR_LAW = 0.2  # Petrini et al. 2021, CIFAR-10 across 15 architectures: test error ~ 0.2 sqrt(R_f)
R_INTERVAL = "95% t interval of the geometric mean"  # on log R_f, as in the summary tables


def plots(rows: list[dict], layer_rows: list[dict], runs: list[Run], settings: Settings, output: Path) -> list[Path]:
    """rf_vs_delta.png, rf_per_layer.png, rf_vs_error.png and, with runs at hand, deformed_examples.png."""
    summary = seed_summary(rows)
    style = _Style(list(dict.fromkeys(r["group"] for r in rows)), settings)
    files = [
        rf_vs_delta(summary, style, settings, output / "rf_vs_delta.png"),
        rf_per_layer(layer_summary(layer_rows), style, settings, output / "rf_per_layer.png"),
        rf_vs_error(rows, summary, style, settings, output / "rf_vs_error.png"),
    ]
    if runs:  # summarizing earlier measurements (--combine) has no images at hand
        files.append(deformed_examples(runs[0].images[0], settings, output / "deformed_examples.png"))
    return files


def rf_vs_delta(summary: list[dict], style: _Style, settings: Settings, path: Path) -> Path:
    """R_f against delta, a panel per cut (Fig. 3 left of Petrini et al. 2021)."""
    fig = Figure(figsize=(4.5 * len(settings.cuts) + 2.5, 4), layout="constrained")
    axes = fig.subplots(1, len(settings.cuts), squeeze=False, sharey=True)[0]
    for ax, cut in zip(axes, settings.cuts):
        _curves(ax, style, [s for s in summary if s["cut"] == cut], "delta")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set(xlabel="delta (pixels; series shifted apart)", yscale="log", title=f"c = {cut} ({settings.convention})")
        ax.set_xticks(sorted({s["delta"] for s in summary if s["cut"] == cut}))
        log_ticks(ax.yaxis)
    axes[0].set_ylabel("R_f")
    shared_legend(fig, axes, title=style.legend_title(summary))
    return save_figure(fig, path, dpi=120)


def rf_per_layer(layers: list[dict], style: _Style, settings: Settings, path: Path) -> Path:
    """R_f of every block against its relative depth, at the main point (Fig. 14 of Petrini et al. 2021)."""
    fig = Figure(figsize=(8.5, 4), layout="constrained")
    ax = fig.subplots()
    _curves(ax, style, layers, "relative_depth")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set(
        xlabel="relative depth (block / number of blocks; 1 = logits; series shifted apart)",
        ylabel="R_f",
        yscale="log",
        title=f"R_f per layer, delta = {settings.main_delta}, c = {settings.cuts[0]} ({settings.convention})",
    )
    log_ticks(ax.yaxis)
    shared_legend(fig, [ax], title=style.legend_title(layers))
    return save_figure(fig, path, dpi=120)


def rf_vs_error(rows: list[dict], summary: list[dict], style: _Style, settings: Settings, path: Path) -> Path:
    """Test error against R_f at the main point: each run as a faint dot, each group and checkpoint as its
    means with their intervals on both axes, and the paper's 0.2 sqrt(R_f) line (Fig. 5)."""
    main_point = (settings.main_delta, settings.cuts[0])
    main = [r for r in rows if (r["delta"], r["cut"]) == main_point and r["R"] > 0 and r["test_error"] > 0]
    means = [s for s in summary if (s["delta"], s["cut"]) == main_point and s["R"] > 0 and s["test_error"] > 0]
    fig = Figure(figsize=(8.5, 4.5), layout="constrained")
    ax = fig.subplots()
    for group, checkpoint in style.series():
        mine = [r for r in main if (r["group"], r["checkpoint"]) == (group, checkpoint)]
        ax.scatter(
            [r["R"] for r in mine],
            [r["test_error"] / 100 for r in mine],
            s=9,
            alpha=0.4,
            color=style.colors[group],
            facecolors=style.face(group, checkpoint),
            label="_single runs",
        )
        point = [s for s in means if (s["group"], s["checkpoint"]) == (group, checkpoint)]
        (R, R_spread), (error, error_spread) = _bars(point, "R"), _bars(point, "test_error", scale=0.01)
        style.errorbar(ax, group, checkpoint, R, error, xerr=R_spread, yerr=error_spread, linestyle="none")
    if main:
        lo, hi = min(r["R"] for r in main), max(r["R"] for r in main)
        grid = [lo * (hi / lo) ** (i / 20) for i in range(21)] if hi > lo else [lo]
        ax.plot(grid, [ERROR_LAW * math.sqrt(x) for x in grid], "k--", lw=0.8, label="0.2 sqrt(R_f) (CIFAR-10, paper)")
    ax.set(
        xlabel=f"R_f (delta = {settings.main_delta}, c = {settings.cuts[0]})",
        ylabel="test error",
        title="test error vs relative stability" + ("" if main else ": no run with R_f > 0 and test error > 0"),
    )
    if main:  # log axes need a positive point (R_f is undefined where D_f = G_f = 0, and 0 where D_f = 0)
        ax.set(xscale="log", yscale="log")
        log_ticks(ax.xaxis)
        log_ticks(ax.yaxis)
    note = style.legend_title(means, extra=" (R_f) and of the mean (test error); small dots: single runs")
    shared_legend(fig, [ax], title=note)
    return save_figure(fig, path, dpi=120)


def deformed_examples(image: torch.Tensor, settings: Settings, path: Path) -> Path:
    """One row per delta measured (the grid's: --deltas and --main-delta), one column per cut: the image
    under one diffeomorphism of the temperature that gives that typical displacement."""
    deltas = sorted({delta for delta, _ in settings.grid})
    fig = Figure(figsize=(2 * (len(settings.cuts) + 1), 2 * len(deltas)), layout="constrained")
    axes = fig.subplots(len(deltas), len(settings.cuts) + 1, squeeze=False)
    generator = torch.Generator().manual_seed(settings.seed)
    size = image.shape[-2:]
    for row, delta in zip(axes, deltas):
        _show(row[0], image, "original")
        for ax, cut in zip(row[1:], settings.cuts):
            T = diffeo.temperature(delta, cut, size)
            deformed = diffeo.deform(
                image, T, cut, generator=generator, interpolation=settings.interpolation, modes=settings.modes
            )
            _show(ax, deformed, f"delta={delta:g}, c={cut}\nT={T:.2g}")
    return save_figure(fig, path, dpi=120)


class _Style:
    """One color per group (distinct colors), and per checkpoint: the first one dashed with open markers."""

    def __init__(self, groups: list[str], settings: Settings):
        self.colors = dict(zip(groups, qualitative_colors(len(groups))))
        self.checkpoints = settings.checkpoints
        self.first = settings.checkpoints[0] if len(settings.checkpoints) > 1 else None

    def series(self) -> list[tuple[str, str]]:
        return [(group, checkpoint) for group in self.colors for checkpoint in self.checkpoints]

    def face(self, group: str, checkpoint: str) -> str | tuple:
        return "none" if checkpoint == self.first else self.colors[group]

    def errorbar(
        self,
        ax: Axes,
        group: str,
        checkpoint: str,
        x: list[float],
        y: list[float],
        xerr: list[list[float]] | None = None,
        yerr: list[list[float]] | None = None,
        linestyle: str | None = None,
    ) -> None:
        """One series with its error bars, labelled 'group, checkpoint'."""
        if x:
            ax.errorbar(
                x,
                y,
                xerr=xerr,
                yerr=yerr,
                color=self.colors[group],
                linestyle=linestyle or ("--" if checkpoint == self.first else "-"),
                marker="o",
                ms=4,
                mfc=self.face(group, checkpoint),
                capsize=2,
                elinewidth=0.8,
                label=f"{group}, {checkpoint}",
            )

    def legend_title(self, points: list[dict], extra: str = "") -> str:
        styles = "" if self.first is None else f"{self.first}: dashed / open, others: solid\n"
        return f"{styles}{error_bar_note((p['n'] for p in points), R_INTERVAL)}{extra}"


def _curves(ax: Axes, style: _Style, points: list[dict], x: str) -> None:
    """R_f of summary rows against `x`, a series per group and checkpoint, each shifted by a part of the grid's
    step (evaluation.figures.dodged) so that the error bars of series at the same point stay apart."""
    grid = [p[x] for p in points]
    series = style.series()
    for i, (group, checkpoint) in enumerate(series):
        mine = sorted((p for p in points if (p["group"], p["checkpoint"]) == (group, checkpoint)), key=lambda p: p[x])
        R, spread = _bars(mine, "R")
        style.errorbar(ax, group, checkpoint, dodged([p[x] for p in mine], i, len(series), grid), R, yerr=spread)


def _bars(points: list[dict], key: str, scale: float = 1.0) -> tuple[list[float], list[list[float]]]:
    """The centres of `key` and their intervals as [below, above] the centre, from a summary table's rows
    (`key`, `key_low`, `key_high`; no bar where n = 1), times `scale`."""
    centre = [scale * p[key] for p in points]
    below = [error_bar(c - scale * p[f"{key}_low"]) for c, p in zip(centre, points)]
    above = [error_bar(scale * p[f"{key}_high"] - c) for c, p in zip(centre, points)]
    return centre, [below, above]


def _show(ax: Axes, image: torch.Tensor, title: str) -> None:
    ax.imshow(displayable(image), cmap="gray")
    ax.set_title(title, fontsize=7)
    ax.axis("off")
