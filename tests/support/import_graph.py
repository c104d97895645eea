"""The package's imports read from its source (module level and inside functions), for the tests of its
layering (test_package_imports.py) and of the engine's (test_engine_imports.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from support import REPO


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(folder: Path, root: Path = REPO) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(folder.rglob("*.py"))}


def imports(path: Path, root: Path = REPO) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, line) for every import in the file; `from X import name` names
    X.name when that is a module, else X."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, inside, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module
                for alias in child.names:
                    found.append((f"{target}.{alias.name}", inside, child.lineno))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The module of ``modules`` an import reaches (the longest prefix of its name), or None."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def edges(modules: dict[str, Path], root: Path = REPO) -> list[tuple[str, str, bool, int]]:
    """(importing module, imported module, inside a function, line) between ``modules``; a module's import of
    its own package's ``__init__`` (``from . import name`` of a non-module name) is not an edge."""
    found = []
    for name, path in modules.items():
        for target, inside, line in imports(path, root):
            reached = resolve(target, modules)
            if reached and reached != name and not name.startswith(reached + "."):
                found.append((name, reached, inside, line))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``graph`` meets, each as its nodes with the first repeated."""
    visiting: list[str] = []
    done: set[str] = set()
    found: list[list[str]] = []

    def walk(node: str) -> None:
        if node in done:
            return
        if node in visiting:
            found.append(visiting[visiting.index(node) :] + [node])
            return
        visiting.append(node)
        for nxt in sorted(graph.get(node, ())):
            walk(nxt)
        visiting.pop()
        done.add(node)

    for node in sorted(graph):
        walk(node)
    return found
