"""The phase diagram's tables from its CSVs, with an interval in every cell: mean single-net test error
over seeds, the ensemble's error with the test set's sampling interval, the kernel change on a log
scale, and the fraction of nets that fit their training set."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from convbias.base.tables import markdown_table

from ..intervals import proportion_interval, t_half_width
from .study import CELLS_CSV, NETS_CSV, read_cells, read_nets


def mean_interval(values: Sequence[float]) -> str:
    """mean [95% t interval] of replicate values; one value has no interval."""
    values = [float(v) for v in values]
    mean = float(np.mean(values))
    if len(values) < 2:
        return f"{mean:.2g} (n = 1)"
    half = t_half_width(float(np.std(values, ddof=1)), len(values))
    return f"{mean:.1f} [{mean - half:.1f}, {mean + half:.1f}]"


def geometric_interval(values: Sequence[float]) -> str:
    """Geometric mean [95% t interval on the log scale, mapped back] of positive replicate values."""
    logs = np.log([float(v) for v in values])
    centre = float(np.mean(logs))
    half = t_half_width(float(np.std(logs, ddof=1)), len(logs)) if len(logs) > 1 else 0.0
    low, mid, high = (_short(math.exp(centre + k * half)) for k in (-1, 0, 1))
    return f"{mid} [{low}, {high}]"


def _short(value: float) -> str:
    """Two significant digits without an exponent for the kernel-change range (0.001 to 10^4)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.2g}"


def pivot_table(cells: dict[tuple[Any, Any], str], rows: Sequence[Any], columns: Sequence[Any], corner: str) -> str:
    """Markdown table of `cells[(row, column)]`, one row per `rows` value."""
    body = [
        [f"{row:g}" if isinstance(row, float) else row] + [cells.get((row, c), "–") for c in columns] for row in rows
    ]
    return markdown_table([corner] + [str(c) for c in columns], body).rstrip("\n")


def phase_diagram_tables(directory: str | Path, test_size: int) -> str:
    """The phase diagram's tables with an interval per cell, from its nets.csv (every net) and cells.csv.

    Mean single-net test error: mean [t interval] over the cell's nets (seeds); ensemble test error:
    Clopper-Pearson interval over the `test_size` test images (the test set's sampling only, one
    ensemble per cell); kernel change: geometric mean [t interval of the logs]; nets at zero loss:
    k / n [Clopper-Pearson]."""
    directory = Path(directory)
    nets = read_nets(directory / NETS_CSV, ("width", "alpha_tilde", "test_error", "ntk_change", "converged"))
    cells = {
        (c["alpha_tilde"], c["width"]): c
        for c in read_cells(directory / CELLS_CSV, ("width", "alpha_tilde", "ensemble_test_error"))
    }
    widths = sorted({n["width"] for n in nets})
    alphas = sorted({n["alpha_tilde"] for n in nets}, reverse=True)
    by_cell: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for net in nets:
        by_cell.setdefault((net["alpha_tilde"], net["width"]), []).append(net)
    counts = sorted({len(v) for v in by_cell.values()})
    single = {k: mean_interval([n["test_error"] for n in v]) for k, v in by_cell.items()}
    change = {k: geometric_interval([n["ntk_change"] for n in v]) for k, v in by_cell.items()}
    fitted, ensemble = {}, {}
    for key, members in by_cell.items():
        k = sum(int(n["converged"]) for n in members)
        low, high = proportion_interval(k, len(members))
        fitted[key] = f"{k}/{len(members)} [{low:.0f}, {high:.0f}]%"
        error = cells[key]["ensemble_test_error"]
        low, high = proportion_interval(round(error * test_size / 100), test_size)
        ensemble[key] = f"{error:.1f} [{low:.1f}, {high:.1f}]"
    corner = "alpha~ \\ h"
    n = "-".join(str(c) for c in counts[:: max(1, len(counts) - 1)])
    return "\n\n".join(
        [
            f"Mean single-net test error (%), mean [95% t interval] over n = {n} seeds:\n\n"
            + pivot_table(single, alphas, widths, corner),
            f"Ensemble test error (%) of the n = {n} nets, [95% Clopper-Pearson interval over the {test_size} "
            "test images]:\n\n" + pivot_table(ensemble, alphas, widths, corner),
            f"Kernel change ||dTheta|| / ||Theta_0||, geometric mean [95% t interval of the logs], n = {n}:\n\n"
            + pivot_table(change, alphas, widths, corner),
            "Nets that reached zero training loss, k / n [95% Clopper-Pearson interval]:\n\n"
            + pivot_table(fitted, alphas, widths, corner),
        ]
    )
