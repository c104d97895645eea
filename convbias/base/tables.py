"""Result tables: one CSV writer, one CSV reader and one markdown renderer for every command that writes or reads
results."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from convbias.base.errors import DamagedInputError
from convbias.base.inputs import quoted, read_file
from convbias.base.storage import atomic_write


def write_csv(rows: Sequence[dict[str, Any]], path: str | os.PathLike, columns: Sequence[str] | None = None) -> Path:
    """Write rows as CSV atomically (a reader sees the old file or the new one); LF line endings. A write that
    fails (disk full, read-only) leaves no temporary file and is one StorageError (exit 74) naming ``path``.

    columns: the header (missing cells are empty); default the union of the rows' keys, in first-seen order."""
    path = Path(path)
    columns = list(columns) if columns is not None else list(dict.fromkeys(key for row in rows for key in row))
    text = csv_text(rows, columns)
    atomic_write(path, lambda tmp: tmp.write_text(text, newline=""))
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
    """``read_csv``'s default cell: a number."""
    return float(value)


def read_csv(path: str | os.PathLike, what: str, parse: Callable[[str, str], Any] = number) -> list[dict[str, Any]]:
    """The rows of a results CSV a command wrote earlier (``what`` names it), each cell through ``parse(column,
    value)``; a file that is not a readable regular file or not UTF-8 CSV, or a cell ``parse`` refuses (a
    ValueError or TypeError), is a DamagedInputError (exit 65) naming the file, the line and the column."""
    data = read_file(path, what, DamagedInputError)
    try:
        rows = list(csv.DictReader(io.StringIO(data.decode("utf-8"), newline="")))
    except (UnicodeDecodeError, csv.Error) as e:
        raise DamagedInputError(f"{what} {path} is not a CSV file this package wrote ({e})") from None
    parsed = []
    for line, row in enumerate(rows, start=2):  # line 1 is the header
        cells = {}
        for column, value in row.items():
            try:
                cells[column] = parse(column, value)
            except (TypeError, ValueError):
                raise DamagedInputError(
                    f"{what} {path}: line {line}, column {column}: unexpected value {quoted(value)}"
                ) from None
        parsed.append(cells)
    return parsed


def markdown_table(header: Sequence[str], body: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells are rendered with str()."""
    lines = ["| " + " | ".join(str(cell) for cell in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines) + "\n"
