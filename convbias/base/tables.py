"""Result tables: one CSV writer, one CSV reader and one markdown renderer for every command that writes or reads
results.

A table a command wrote and another reads back is read by ``read_csv`` against the columns its writer declares:
each required column present, every cell through its column's parser (``number``, ``finite``, ``integer``,
``text``), at least one row; whatever is not so is one DamagedInputError (exit 65) naming the file, and for a
cell its line and column."""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from convbias.base.errors import DamagedInputError
from convbias.base.inputs import quoted, read_file
from convbias.base.storage import write_text

Cell = Callable[[str, str], Any]  # (column, value) -> the cell's value; ValueError or TypeError refuses it


def write_csv(
    rows: Sequence[dict[str, Any]],
    path: str | os.PathLike,
    columns: Sequence[str] | None = None,
    owner: str | os.PathLike | None = None,
) -> Path:
    """Write rows as CSV atomically (a reader sees the old file or the new one); LF line endings. A write that
    fails (disk full, read-only) leaves no temporary file and is one StorageError (exit 74) naming ``path``.

    columns: the header (missing cells are empty); default the union of the rows' keys, in first-seen order.
    owner: the folder the writer owns (``storage.atomic_write``), for a table another command reads back."""
    path = Path(path)
    columns = list(columns) if columns is not None else list(dict.fromkeys(key for row in rows for key in row))
    text = csv_text(rows, columns)
    write_text(path, text, owner)
    return path


def csv_text(rows: Iterable[dict[str, Any]], columns: Sequence[str], header: bool = True) -> str:
    """Rows as CSV text in the given columns (missing cells empty, other keys ignored; floats as repr, None
    empty); LF line endings. Without the header: the lines that append rows to a file of these columns."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def number(column: str, value: str) -> float:
    """``read_csv``'s default cell: a number (NaN, written for an undefined value, included)."""
    return float(value)


def finite(column: str, value: str) -> float:
    """A number that must be finite: an identifying value (a fraction, a delta) or an accuracy."""
    parsed = float(value)
    if not math.isfinite(parsed):
        raise ValueError("expected a finite number")
    return parsed


def integer(column: str, value: str) -> int:
    """A whole number (a seed, a count), as written or as a float's repr of one ('3.0')."""
    parsed = finite(column, value)
    if not parsed.is_integer():
        raise ValueError("expected a whole number")
    return int(parsed)


def text(column: str, value: str) -> str:
    """Text, as written."""
    return value


def optional(cell: Cell, missing: Any = None) -> Cell:
    """``cell``, or ``missing`` for an empty cell (a value the writer did not have)."""
    return lambda column, value: missing if value == "" else cell(column, value)


def by_column(columns: Mapping[str, Cell], other: Cell = text) -> Cell:
    """The cell parser of a declared table: each declared column's own, ``other`` for the rest."""
    return lambda column, value: columns.get(column, other)(column, value)


def read_csv(
    path: str | os.PathLike,
    what: str,
    parse: Cell = number,
    required: Sequence[str] = (),
    rows: bool = False,
) -> list[dict[str, Any]]:
    """The rows of a results CSV a command wrote earlier (``what`` names it), each cell through ``parse(column,
    value)``. A DamagedInputError (exit 65) naming the file when it is not a plain regular file (a link of
    either kind, a FIFO: ``inputs.check_plain_file``) or not UTF-8 CSV, lacks a ``required`` column, holds no row
    while ``rows`` requires one, or, naming the line and the column too, has a row of another length or a cell
    ``parse`` refuses (a ValueError or TypeError)."""
    data = read_file(path, what, DamagedInputError, plain=True)
    try:
        reader = csv.DictReader(io.StringIO(data.decode("utf-8"), newline=""))
        found = list(reader)
        header = reader.fieldnames or []
    except (UnicodeDecodeError, csv.Error) as e:
        raise DamagedInputError(f"{what} {path} is not a CSV file this package wrote ({e})") from None
    if rows and not found:
        empty = "a header only" if header else "it is empty"
        raise DamagedInputError(f"{what} {path} holds no rows ({empty}): not a table its command wrote")
    missing = [column for column in required if column not in header]
    if missing:
        raise DamagedInputError(
            f"{what} {path} has no {', '.join(map(repr, missing))} column{'s' if len(missing) > 1 else ''} "
            f"(its header: {quoted(','.join(header), 120)}): not a table its command wrote"
        )
    parsed = []
    for line, row in enumerate(found, start=2):  # line 1 is the header
        if None in row or None in row.values():
            raise DamagedInputError(f"{what} {path}: line {line} has not the {len(header)} cells of its header")
        cells = {}
        for column, value in row.items():
            try:
                cells[column] = parse(column, value)
            except (TypeError, ValueError) as e:
                expected = f" ({e})" if str(e).startswith("expected") else ""
                raise DamagedInputError(
                    f"{what} {path}: line {line}, column {column}: unexpected value {quoted(value)}{expected}"
                ) from None
        parsed.append(cells)
    return parsed


def markdown_table(header: Sequence[str], body: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells are rendered with str()."""
    lines = ["| " + " | ".join(str(cell) for cell in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines) + "\n"
