"""The package's layers and the one direction of their dependencies, read from the source of every module of
convbias/, the families and train.py, imports inside functions included: a part imports only parts on a
lower level, so no two parts import each other, directly or around a cycle; and the rest of the package reaches
the engine through its facade (`convbias.engine`), never one of its submodules. The engine's own packages keep
their rule too (test_engine_imports.py)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
from support import REPO
from support.import_graph import cycles, edges, imports, modules_under, resolve

from convbias.families import FAMILIES

ENGINE = "convbias.engine"  # the facade: what the rest of the package imports of the engine
# from the bottom: a part may import its own modules and those of parts on a lower level
LEVELS = {
    "convbias": 0,  # the namespace's docstring; imports nothing
    "base": 0,  # errors and exit codes, file reads and writes, the run directory's layout, weight files
    "gpsa": 1,  # the GPSA layer, its positional products and kernels
    **dict.fromkeys(FAMILIES, 2),  # the model families: the GPSA layer and the base, never the engine
    "engine": 2,  # the training engine: names no family
    "evaluation": 3,  # measurements of trained models
    "families": 4,  # convbias/families.py, the composition root: the families and the engine's extensions
    "studies": 5,  # one package per study: its runs, report, figures and console script
    "sharing": 5,  # export, the Hub, prediction
    "cli": 6,  # the generic console scripts and train.py
}


def package_modules(root: Path = REPO) -> dict[str, Path]:
    found = {"train": root / "train.py"}
    for top in ("convbias", *FAMILIES):
        found.update(modules_under(root / top, root))
    return found


def part_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "train":
        return "cli"
    if parts[0] != "convbias" or len(parts) == 1:
        return parts[0]
    return parts[1]


def wrong_edges(root: Path = REPO) -> list[str]:
    found = []
    for source, target, inside, line in edges(package_modules(root), root):
        here, there = part_of(source), part_of(target)
        if here != there and LEVELS[there] >= LEVELS[here]:
            where = "inside a function" if inside else "at module level"
            found.append(f"{source}:{line} imports {target} ({where}): {here} may not import {there}")
    return found


def engine_submodules_imported(root: Path = REPO) -> list[str]:
    """Every import of one of the engine's submodules (`from convbias.engine.loop import x`, `import
    convbias.engine.data.factory`, `from convbias.engine import loop`) by a module of the package outside the
    engine, at module level or inside a function. `from convbias.engine import name` of a facade name is none."""
    modules = package_modules(root)
    engine = {name: path for name, path in modules.items() if part_of(name) == "engine"}
    found = []
    for module, path in modules.items():
        if module in engine:
            continue
        for target, inside, line in imports(path, root):
            reached = resolve(target, engine)
            if reached is not None and reached != ENGINE:
                where = "inside a function" if inside else "at module level"
                found.append(f"{module}:{line} imports {reached} ({where}): import its names from {ENGINE}")
    return found


def test_every_module_is_in_a_part():
    """The convbias/ root holds only the namespace and the composition root; every other module is in a part."""
    loose = [m for m in package_modules() if part_of(m) not in LEVELS]
    assert not loose, f"modules outside the parts {sorted(LEVELS)}: {loose}"
    root = sorted(p.name for p in (REPO / "convbias").iterdir() if p.suffix == ".py")
    assert root == ["__init__.py", "families.py"]


def test_parts_import_only_parts_below_them():
    wrong = wrong_edges()
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_cycle_between_parts():
    graph: dict[str, set[str]] = {}
    for source, target, _, _ in edges(package_modules()):
        if part_of(source) != part_of(target):
            graph.setdefault(part_of(source), set()).add(part_of(target))
    assert not cycles(graph)


@pytest.mark.parametrize(
    "module, planted, expected",
    [
        # the engine reporting through the console scripts' package, deferred into a function
        (
            "convbias/engine/__init__.py",
            "def _planted():\n    from convbias.cli import report\n",
            "engine may not import cli",
        ),
        # the bottom layer reaching up into the engine at module level
        (
            "convbias/base/storage.py",
            "from convbias.engine.rundir import reader\n",
            "base may not import engine",
        ),
        # a study's console script reaching up for the generic commands' helpers
        (
            "convbias/studies/sweep/command.py",
            "def _planted():\n    from convbias.cli import OptionParser\n",
            "studies may not import cli",
        ),
        # the composition root reaching up into a study
        ("convbias/families.py", "from convbias.studies.stability import study\n", "families may not import studies"),
        # a family importing the engine
        ("convit/models.py", "import convbias.engine.loop.trainer\n", "convit may not import engine"),
    ],
)
def test_a_planted_wrong_edge_fails(tmp_path, module, planted, expected):
    """The rule reads real files: an import against it, written into a copy of the package, is reported."""
    copy_package(tmp_path)
    assert wrong_edges(tmp_path) == []
    target = tmp_path / module
    target.write_text(target.read_text() + "\n" + planted)
    assert any(expected in line for line in wrong_edges(tmp_path)), wrong_edges(tmp_path)


def copy_package(root: Path) -> None:
    for top in ("convbias", *FAMILIES):
        shutil.copytree(REPO / top, root / top, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "train.py", root / "train.py")


def test_the_package_imports_the_engine_through_its_facade():
    found = engine_submodules_imported()
    assert not found, "imports past the engine's facade (add the name to convbias/engine/__init__.py):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "module, planted, expected",
    [
        # a study's module reaching into the config package at module level
        (
            "convbias/studies/sweep/spec.py",
            "from convbias.engine.config.options import option_names\n",
            "convbias.studies.sweep.spec:{line} imports convbias.engine.config.options (at module level)",
        ),
        # a console script importing a module of the data package, deferred into a function
        (
            "convbias/cli/launch.py",
            "def _planted():\n    import convbias.engine.data.factory\n",
            "convbias.cli.launch:{line} imports convbias.engine.data.factory (inside a function)",
        ),
        # a submodule named through the facade's package
        (
            "train.py",
            "from convbias.engine import loop\n",
            "train:{line} imports convbias.engine.loop (at module level)",
        ),
    ],
)
def test_a_planted_import_past_the_facade_fails(tmp_path, module, planted, expected):
    """The rule reads real files: an import of an engine submodule, written into a copy of the package, is
    reported with its line; the facade's own names, imported the same way, are not."""
    copy_package(tmp_path)
    assert engine_submodules_imported(tmp_path) == []
    target = tmp_path / module
    original = target.read_text()
    target.write_text(original + "\n" + planted + "from convbias.engine import Config, RunDir\n")
    line = original.count("\n") + 1 + planted.count("\n")
    assert engine_submodules_imported(tmp_path) == [f"{expected.format(line=line)}: import its names from {ENGINE}"]


YAML_PARSERS = {"load", "safe_load", "full_load", "unsafe_load", "load_all", "safe_load_all", "full_load_all"}
YAML_READER = "convbias.base.inputs"  # bounded, a key given twice refused naming both lines


def yaml_parsed_outside_the_reader(modules: dict[str, Path]) -> list[str]:
    """Calls of PyYAML's parsers (yaml.safe_load, ...) in a module other than the package's one YAML reader."""
    found = []
    for module, path in modules.items():
        text = path.read_text()
        if module == YAML_READER or "yaml." not in text:
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            function = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(function, ast.Attribute)
                and function.attr in YAML_PARSERS
                and isinstance(function.value, ast.Name)
                and function.value.id == "yaml"
            ):
                found.append(f"{module}:{node.lineno} yaml.{function.attr}")
    return found


def test_every_yaml_file_is_read_through_the_one_reader():
    """Recipes, a run's config.yaml, the studies' configs, a sweep file: read_yaml / parse_yaml refuse a key given
    twice, a tag that runs code and an alias bomb; yaml.safe_load would keep the last key without a word."""
    assert yaml_parsed_outside_the_reader(package_modules()) == []


def test_the_yaml_rule_catches_a_planted_parser(tmp_path):
    module = "convbias.studies.regimes.study"
    planted = tmp_path / "study.py"
    source = package_modules()[module].read_text()
    planted.write_text(source + "\n\ndef planted(text):\n    return yaml.safe_load(text)\n")
    found = yaml_parsed_outside_the_reader({module: planted})
    assert len(found) == 1 and found[0].startswith(f"{module}:"), found
