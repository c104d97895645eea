"""What the repository's layout promises a reader: docs/engine.md names only modules and functions that
exist and shows every engine module, results/ holds results only, README.md stays short, tests/README.md
lists every test file under the part it tests, pyproject.toml declares each dependency once."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import tomllib
from support import REPO
from support.engine_doc import package_table

ENGINE = REPO / "convbias" / "engine"
PACKAGES = ("config", "rundir", "data", "model", "optim", "checkpoint", "loop")
README_LINES = 400
CODE_SUFFIXES = (".py", ".sh", ".ipynb")
# `loop.trainer.Trainer.fit`, `checkpoint.manager.CheckpointManager` (under convbias.engine), or a file
# `loop/trainer.py` (under convbias/engine)
DOTTED = re.compile(rf"^(?:convbias\.engine\.)?((?:{'|'.join(PACKAGES)})(?:\.\w+)+)(?:\(\))?$")
FILE = re.compile(rf"^(?:convbias/engine/)?((?:{'|'.join(PACKAGES)})/\w+\.py)$")


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def resolve(dotted: str) -> object:
    """The object `convbias.engine.<dotted>` names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module("convbias.engine." + ".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(dotted)


def test_engine_doc_names_only_what_exists():
    text = (REPO / "docs" / "engine.md").read_text()
    missing, checked = [], 0
    for token in backticked(text):
        if match := DOTTED.match(token):
            checked += 1
            try:
                resolve(match.group(1))
            except (ModuleNotFoundError, AttributeError):
                missing.append(token)
        elif match := FILE.match(token):
            checked += 1
            if not (ENGINE / match.group(1)).is_file():
                missing.append(token)
    assert checked > 40, f"docs/engine.md names only {checked} engine modules and functions"
    assert not missing, f"docs/engine.md names what does not exist: {missing}"


def test_engine_doc_shows_every_package_and_module():
    named = {m.group(1) for token in backticked((REPO / "docs" / "engine.md").read_text()) if (m := FILE.match(token))}
    modules = {str(p.relative_to(ENGINE)) for p in ENGINE.glob("*/*.py") if p.name != "__init__.py"}
    assert modules <= named, f"engine modules docs/engine.md does not show: {sorted(modules - named)}"


def tree_of(engine: Path) -> dict[str, set[str]]:
    """Each engine package's modules, as the tree holds them."""
    return {
        package.name: {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
        for package in sorted(engine.iterdir())
        if (package / "__init__.py").is_file()
    }


def test_engine_docs_package_table_is_the_tree():
    shown = {package: modules for package, (modules, _) in package_table().items()}
    assert shown == tree_of(ENGINE)


def test_a_module_the_table_omits_is_caught(tmp_path):
    for package, modules in tree_of(ENGINE).items():
        (tmp_path / package).mkdir()
        for name in ["__init__", *modules]:
            (tmp_path / package / f"{name}.py").write_text("")
    assert {p: m for p, (m, _) in package_table().items()} == tree_of(tmp_path)
    (tmp_path / "rundir" / "planted.py").write_text("")
    assert {p: m for p, (m, _) in package_table().items()} != tree_of(tmp_path)


def test_a_wrong_name_in_the_doc_is_caught():
    assert DOTTED.match("loop.trainer.Trainer.no_such_method")
    try:
        resolve("loop.trainer.Trainer.no_such_method")
    except AttributeError:
        return
    raise AssertionError("a name that does not exist resolved")


def test_results_hold_results_only():
    code = [str(p.relative_to(REPO)) for p in (REPO / "results").rglob("*") if p.suffix in CODE_SUFFIXES]
    assert not code, f"code under results/ (it belongs in the package or benchmarks/): {code}"


def test_readme_stays_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines; the depth goes to docs/"


def test_each_dependency_is_declared_once():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for group, requirements in {"dependencies": project["dependencies"], **project["optional-dependencies"]}.items():
        names = [re.match(r"[A-Za-z0-9_.-]+", requirement).group().lower() for requirement in requirements]
        assert len(names) == len(set(names)), f"{group}: {sorted(n for n in set(names) if names.count(n) > 1)} twice"


# tests/ mirrors the package: a folder per part, named as the part's package (convbias/engine/loop ->
# tests/engine/loop, a family's package -> tests/convit), and these folders that are no part of it
TEST_FOLDERS_OF_NO_PART = {"support", "data", "toy_family", "repository", "families", "benchmarks"}


def parts_without_a_package(root: Path) -> list[str]:
    """The folders under root/tests holding test files whose path names no package of the repository:
    tests/A/B is convbias/A/B, or the family package A/B."""
    tests = root / "tests"
    folders = {p.parent.relative_to(tests) for p in tests.rglob("test_*.py")}
    stray = []
    for folder in sorted(folders):
        if len(folder.parts) == 1 and folder.parts[0] in TEST_FOLDERS_OF_NO_PART:
            continue
        if not any((root / top / folder / "__init__.py").is_file() for top in ("convbias", ".")):
            stray.append(str(folder))
    return stray


def test_tests_are_a_tree_of_the_package():
    tests = REPO / "tests"
    assert not list(tests.glob("test_*.py")), "a test file at tests/'s top: it belongs in its part's folder"
    assert not parts_without_a_package(REPO)


def test_a_test_folder_that_names_no_part_is_caught(tmp_path):
    (tmp_path / "convbias" / "engine" / "loop").mkdir(parents=True)
    (tmp_path / "convbias" / "engine" / "loop" / "__init__.py").write_text("")
    for folder in ("engine/loop", "engine/lop", "support"):
        (tmp_path / "tests" / folder).mkdir(parents=True)
        (tmp_path / "tests" / folder / "test_x.py").write_text("")
    assert parts_without_a_package(tmp_path) == ["engine/lop"]
