"""Tests a maintainer can find: every module of the package (convbias/ and the three families; train.py is a
script) is imported by name by at least one file under tests/, read from the source as test_package_imports.py
reads the package. A module reached only through another one's imports has no test that names it, so a change
to it sends nobody to a test file."""

from __future__ import annotations

import shutil
from pathlib import Path

from import_graph import REPO, imports, modules_under

PACKAGES = ("convbias", "convit", "transformed_cnn", "efcn")


def untested_modules(root: Path = REPO) -> list[str]:
    """The package's modules that no file under ``root``/tests imports by name. ``import X``, ``from X import
    name`` and ``from X.Y import Z`` count for the module they name and the packages above it (a package's
    ``__init__`` counts when it or any module under it is imported)."""
    modules: dict[str, Path] = {}
    for top in PACKAGES:
        modules.update(modules_under(root / top, root))
    imported = {target for path in sorted((root / "tests").rglob("*.py")) for target, _, _ in imports(path, root)}
    return [name for name in modules if not any(t == name or t.startswith(name + ".") for t in imported)]


def test_every_module_is_imported_by_a_test():
    untested = untested_modules()
    assert not untested, f"modules no test imports by name (give each a test file, tests/README.md): {untested}"


def test_a_planted_untested_module_is_reported(tmp_path):
    """The rule reads real files: a new module in a copy of the package, which no test imports, is reported,
    and it alone; a test that imports it clears it."""
    ignore = shutil.ignore_patterns("__pycache__", ".venv", ".git")
    for top in (*PACKAGES, "tests"):
        shutil.copytree(REPO / top, tmp_path / top, ignore=ignore)
    before = untested_modules(tmp_path)  # the real tree's (empty when the rule above holds)
    (tmp_path / "convbias" / "base" / "untested_planted.py").write_text('"""Planted: no test imports it."""\n')
    after = untested_modules(tmp_path)
    assert sorted(set(after) - set(before)) == ["convbias.base.untested_planted"] and set(before) <= set(after)
    (tmp_path / "tests" / "test_untested_planted.py").write_text("from convbias.base import untested_planted\n")
    assert untested_modules(tmp_path) == before
