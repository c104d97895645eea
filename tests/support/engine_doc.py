"""The package table of docs/engine.md ("Packages and the rule between them"): each engine package's modules
and the packages it may import, as the doc shows them (the tests check the tree and the imports against it)."""

from __future__ import annotations

import re

from support import REPO

DOC = REPO / "docs" / "engine.md"


def package_table(text: str | None = None) -> dict[str, tuple[set[str], set[str]]]:
    """{package: (its modules, the engine packages it may import)} from the table's code block."""
    text = DOC.read_text() if text is None else text
    block = text.split("## Packages and the rule between them", 1)[1].split("```", 2)[1]
    lines = [line for line in block.splitlines() if line.strip()]
    header = lines[0]
    modules_at, imports_at = header.index("modules"), header.index("imports")
    table: dict[str, tuple[list[str], list[str]]] = {}
    package = None
    for line in lines[1:]:
        if not line.startswith(" "):
            package = line.split()[0].rstrip("/")
            table[package] = ([], [])
        modules, imports = table[package]
        modules.append(line[modules_at:imports_at])
        imports.append(line[imports_at:])

    def words(cells):
        return {w for w in re.split(r"[,\s]+", " ".join(cells)) if w and not w.startswith("(") and not w.endswith(")")}

    return {name: (words(modules), words(imports) - {"torch"}) for name, (modules, imports) in table.items()}
