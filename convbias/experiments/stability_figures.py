"""Figures of `convbias-stability`: R_f against delta, per layer, against the test error, and deformed examples.
Runs that differ only by seed are averaged geometrically, as in Petrini et al. 2021."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch
from matplotlib import colormaps
from matplotlib.figure import Figure

from convbias.evaluation import diffeo

from .stability_study import Run, Settings

ERROR_LAW = 0.2  # Petrini et al. 2021, CIFAR-10 across 15 architectures: test error ~ 0.2 sqrt(R_f)
EXAMPLE_TEMPERATURES = 3  # rows of deformed_examples.png: T_min, their geometric middle, T_max


def _geomean(values: list[float]) -> float:
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, finite)) / len(finite)) if finite else float("nan")


def plots(rows: list[dict], layer_rows: list[dict], runs: list[Run], settings: Settings, output: Path) -> list[Path]:
    groups = list(dict.fromkeys(r["group"] for r in rows))
    colors = {g: colormaps["tab20"](i % 20) for i, g in enumerate(groups)}
    styles = {name: ("--" if name == "init" else "-") for name in settings.checkpoints}
    files = []

    fig = Figure(figsize=(5 * len(settings.cuts), 4))
    axes = fig.subplots(1, len(settings.cuts), squeeze=False)
    for ax, cut in zip(axes[0], settings.cuts):
        for g in groups:
            for name in settings.checkpoints:
                points = defaultdict(list)
                for r in rows:
                    if r["group"] == g and r["checkpoint"] == name and r["cut"] == cut:
                        points[r["delta"]].append(r["R"])
                deltas = sorted(points)
                ax.plot(
                    deltas,
                    [_geomean(points[d]) for d in deltas],
                    styles[name],
                    color=colors[g],
                    marker="o",
                    ms=3,
                    label=_label(g, name, settings),
                )
        ax.set(xlabel="delta (pixels)", ylabel="R_f", yscale="log", title=f"c = {cut} ({settings.convention})")
        ax.axhline(1.0, color="gray", lw=0.5)
    _legend(axes[0][-1], settings)
    files.append(_save(fig, output / "rf_vs_delta.png"))

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for g in groups:
        for name in settings.checkpoints:
            points = defaultdict(list)
            for r in layer_rows:
                if r["group"] == g and r["checkpoint"] == name:
                    points[r["relative_depth"]].append(r["R"])
            depths = sorted(points)
            ax.plot(
                depths,
                [_geomean(points[d]) for d in depths],
                styles[name],
                color=colors[g],
                marker="o",
                ms=3,
                label=_label(g, name, settings),
            )
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set(
        xlabel="relative depth (block / number of blocks; 1 = logits)",
        ylabel="R_f",
        yscale="log",
        title=f"R_f per layer, delta = {settings.main_delta}, c = {settings.cuts[0]} ({settings.convention})",
    )
    _legend(ax, settings)
    files.append(_save(fig, output / "rf_per_layer.png"))

    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    main = [
        r
        for r in rows
        if r["delta"] == settings.main_delta and r["cut"] == settings.cuts[0] and r["R"] > 0 and r["test_error"] > 0
    ]
    markers = dict(zip(sorted({r["train_fraction"] for r in main}), "os^Dv<>"))
    for g in groups:
        for name in settings.checkpoints:
            pts = [r for r in main if r["group"] == g and r["checkpoint"] == name]
            if pts:
                ax.scatter(
                    [p["R"] for p in pts],
                    [p["test_error"] / 100 for p in pts],
                    color=colors[g],
                    marker=markers[pts[0]["train_fraction"]],
                    facecolors="none" if name == "init" else None,
                    label=_label(g, name, settings),
                    s=25,
                )
    if main:
        lo, hi = min(r["R"] for r in main), max(r["R"] for r in main)
        grid = [lo * (hi / lo) ** (i / 20) for i in range(21)] if hi > lo else [lo]
        ax.plot(grid, [ERROR_LAW * math.sqrt(x) for x in grid], "k--", lw=0.8, label="0.2 sqrt(R_f) (CIFAR-10, paper)")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel=f"R_f (delta = {settings.main_delta}, c = {settings.cuts[0]})",
        ylabel="test error",
        title="test error vs relative stability",
    )
    _legend(ax, settings)
    files.append(_save(fig, output / "rf_vs_error.png"))

    if not runs:  # summarizing earlier measurements: no images at hand
        return files
    image = runs[0].images[0]
    fig = Figure(figsize=(2 * (len(settings.cuts) + 1), 2 * EXAMPLE_TEMPERATURES))
    axes = fig.subplots(EXAMPLE_TEMPERATURES, len(settings.cuts) + 1, squeeze=False)
    generator = torch.Generator().manual_seed(settings.seed)
    for row in range(EXAMPLE_TEMPERATURES):
        _show(axes[row][0], image, "original" if row == 0 else "")
        for col, cut in enumerate(settings.cuts, start=1):
            t_min, t_max = diffeo.temperature_range(cut, image.shape[-2:])
            T = t_min * (t_max / t_min) ** (row / (EXAMPLE_TEMPERATURES - 1))
            delta = diffeo.typical_displacement(T, cut, image.shape[-2:])
            _show(
                axes[row][col],
                diffeo.deform(
                    image, T, cut, generator=generator, interpolation=settings.interpolation, modes=settings.modes
                ),
                f"c={cut} T={T:.2g}\ndelta={delta:.2f}",
            )
    files.append(_save(fig, output / "deformed_examples.png"))
    return files


def _label(group: str, checkpoint: str, settings: Settings) -> str | None:
    """One legend entry per group (its last checkpoint); the others differ by line style / open markers."""
    return group if checkpoint == settings.checkpoints[-1] else None


def _legend(ax, settings: Settings) -> None:
    others = ", ".join(f"{name}: {'dashed / open' if name == 'init' else 'solid'}" for name in settings.checkpoints)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5), title=others, title_fontsize=6)


def _show(ax, image: torch.Tensor, title: str) -> None:
    pixels = image.float().cpu()
    pixels = (pixels - pixels.min()) / (pixels.max() - pixels.min()).clamp_min(1e-12)
    ax.imshow(pixels[0] if pixels.shape[0] == 1 else pixels.permute(1, 2, 0), cmap="gray")
    ax.set_title(title, fontsize=7)
    ax.axis("off")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
