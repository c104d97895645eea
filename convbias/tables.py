"""Result tables: one CSV writer and one markdown renderer for every command that writes results."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def write_csv(rows: Sequence[dict[str, Any]], path: str | os.PathLike, columns: Sequence[str] | None = None) -> Path:
    """Write rows as CSV atomically (a reader sees the old file or the new one); LF line endings.

    columns: the header (missing cells are empty); default the union of the rows' keys, in first-seen order."""
    path = Path(path)
    columns = list(columns) if columns is not None else list(dict.fromkeys(key for row in rows for key in row))
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
    return path


def markdown_table(header: Sequence[str], body: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells are rendered with str()."""
    lines = ["| " + " | ".join(str(cell) for cell in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines) + "\n"
