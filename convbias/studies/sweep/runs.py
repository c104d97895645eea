"""The runs of a sweep CSV as the report reads them: parsed rows, which columns are the compared models and the
swept factors, the runs of one setting, and the labels that name settings in tables and figures.

The CSV has one row per run (written by ``convbias.studies.sweep.sweep``): the grid factors (``variant`` or
``model``, ``train_fraction``, any swept option such as ``locality_strength``), the replicate ``seed`` and the
results (``top1``, ``top5``, ``best_top1``, ...).
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any

from convbias.base import tables
from convbias.base.errors import ConfigError

from .sweep import RESULT_COLUMNS, TIME_COLUMN

METRIC_COLUMNS = (*RESULT_COLUMNS.values(), TIME_COLUMN)
ID_COLUMNS = ("run", "seed")

Rows = list[dict[str, Any]]


def _parse(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def _finite(low: float = -math.inf, high: float = math.inf) -> tables.Cell:
    """A number in [low, high] (NaN and infinities refused), as ``_parse`` gives it (an int stays an int)."""

    def cell(column: str, value: str) -> Any:
        parsed = _parse(value)
        if value == "":
            return value
        if not isinstance(parsed, (int, float)) or not (math.isfinite(parsed) and low <= parsed <= high):
            raise ValueError(f"expected a finite number{f' in [{low:g}, {high:g}]' if math.isfinite(high) else ''}")
        return parsed

    return cell


def _whole(column: str, value: str) -> Any:
    return value if value == "" else tables.integer(column, value)


def _run_name(column: str, value: str) -> str:
    """A run's folder name under the sweep's runs/ (what ``Run.name`` gives): one name, no path."""
    if not value or value in (".", "..") or "/" in value or "\\" in value:
        raise ValueError("expected the name of a run folder")
    return value


# The columns of runs.csv that the sweep writes (``Sweep.collect``) and the phase diagram in its schema, each with
# how it is read; a swept factor's column is read as a number where it is one, else as text
RUN_COLUMNS: dict[str, tables.Cell] = {
    "run": _run_name,
    **dict.fromkeys(("variant", "model"), tables.text),
    "train_fraction": _finite(0, 1),
    **dict.fromkeys(("seed", "best_epoch", "epochs_trained"), _whole),
    **dict.fromkeys(("top1", "top5", "best_top1", "best_top5"), _finite(0, 100)),
    TIME_COLUMN: _finite(0),
}
# The columns of ensembles.csv (``Sweep.collect_ensembles``, the phase diagram's in the same schema)
ENSEMBLE_COLUMNS: dict[str, tables.Cell] = {
    **RUN_COLUMNS,
    **dict.fromkeys(("members", "images"), _whole),
    **dict.fromkeys(("ensemble_top1", "member_top1"), _finite(0, 100)),
    **dict.fromkeys(("member_top1_std", "fluctuation"), _finite(0)),
}


def read_runs_like(
    path: str | Path,
    what: str = "results table",
    columns: dict[str, tables.Cell] = RUN_COLUMNS,
    required: tuple[str, ...] = (),
) -> Rows:
    """A results CSV with at least one row, each declared column parsed as declared (``columns``), any other
    number parsed; empty cells dropped. DamagedInputError naming the file (and line and column) otherwise."""
    parse = tables.by_column(columns, lambda _, value: _parse(value))
    rows = tables.read_csv(path, what, parse, required=required, rows=True)
    return [{key: value for key, value in row.items() if value != ""} for row in rows]


def read_runs(path: str | Path, required: tuple[str, ...] = ("model", "top1")) -> Rows:
    """Read a sweep CSV (``RUN_COLUMNS``): numbers become int/float, empty cells are dropped; the ``required``
    columns must be there (the report's: the compared model and its top-1)."""
    path = Path(path)
    if not os.path.lexists(path):
        raise ConfigError(f"CSV not found: {path}")
    return read_runs_like(path, "sweep runs table", RUN_COLUMNS, required)


def compared_column(rows: Rows) -> str:
    """The column that names the compared models: ``variant`` if the sweep had variants."""
    return "variant" if "variant" in rows[0] else "model"


def parameter_columns(rows: Rows) -> list[str]:
    """Swept factors other than the compared model and the train fraction."""
    skip = set(METRIC_COLUMNS) | set(ID_COLUMNS) | {"model", "variant", "train_fraction"}
    return [column for column in rows[0] if column not in skip]


def column_values(rows: Rows, column: str) -> list[Any]:
    """The distinct values of a column, in the order the runs give them (None for a row without it)."""
    return list(dict.fromkeys(row.get(column) for row in rows))


def select_runs(rows: Rows, **where: Any) -> Rows:
    """The runs whose columns have the given values."""
    return [row for row in rows if all(row.get(k) == v for k, v in where.items())]


def train_fractions(rows: Rows) -> list[float]:
    """The train fractions of the runs, smallest first."""
    return sorted(column_values(rows, "train_fraction"))


def group_runs(rows: Rows, columns: list[str]) -> list[tuple[dict[str, Any], Rows]]:
    """Rows split by the values of ``columns`` (one group with everything if there are none)."""
    if not columns:
        return [({}, rows)]
    out = []
    for setting in itertools.product(*(column_values(rows, c) for c in columns)):
        where = dict(zip(columns, setting))
        selected = select_runs(rows, **where)
        if selected:
            out.append((where, selected))
    return out


def choose_baseline(rows: Rows, baseline: str | None = None) -> str:
    """The baseline model: the one given, else the only compared name containing 'deit'."""
    column = compared_column(rows)
    names = column_values(rows, column)
    if baseline is not None:
        if baseline not in names:
            raise ConfigError(f"baseline '{baseline}' is not in the CSV's {column} column {names}")
        return baseline
    deits = [name for name in names if "deit" in str(name).lower()]
    if len(deits) != 1:
        raise ConfigError(f"cannot tell the baseline among {names}; pass --baseline NAME")
    return deits[0]


def fraction_label(value: float) -> str:
    """0.05 -> '5%'."""
    return f"{100 * value:g}%"


def metric_label(metric: str) -> str:
    """'best_top1' -> 'best top-1'."""
    return metric.replace("top1", "top-1").replace("_", " ")


def setting_title(where: dict[str, Any]) -> str:
    """{'width': 8, 'alpha': 1} -> 'width=8, alpha=1'."""
    return ", ".join(f"{k}={v}" for k, v in where.items())
