"""The engine's packages and the one direction of their dependencies, read from the source of every engine
module: config <- rundir <- {data, model, optim} <- checkpoint <- loop, where rundir (what every command reads)
imports only config, and checkpoint (what the loop saves and resumes) no data and no model; no cycle between
modules, no import inside a function unless the module says why, no torch in config."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from support import REPO, import_graph
from support.engine_doc import package_table
from support.import_graph import cycles

ENGINE = REPO / "convbias" / "engine"
# the engine packages each package may import besides its own modules (and convbias.base, below the engine), as
# docs/engine.md's package table says
MAY_IMPORT = {package: imports for package, (_, imports) in package_table().items()}
RULE = "config <- rundir <- {data, model, optim} <- checkpoint (no data, no model) <- loop"
HEAVY = ("torch", "timm", "accelerate", "numpy", "safetensors", "torchvision")  # none in config


def engine_modules() -> dict[str, Path]:
    return import_graph.modules_under(ENGINE, ENGINE.parent.parent)


def imports(path: Path) -> list[tuple[str, bool, int]]:
    return import_graph.imports(path, ENGINE.parent.parent)


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in MAY_IMPORT else None


def edges() -> list[tuple[str, str, bool, int]]:
    return import_graph.edges(engine_modules(), ENGINE.parent.parent)


def test_the_rule_is_the_one_the_doc_states():
    assert MAY_IMPORT["rundir"] == {"config"} and not {"data", "model"} & MAY_IMPORT["checkpoint"]
    assert MAY_IMPORT["config"] == set() and set(MAY_IMPORT["loop"]) == set(MAY_IMPORT) - {"loop"}


def test_every_engine_module_lives_in_a_package():
    loose = [m for m in engine_modules() if m != "convbias.engine" and package_of(m) is None]
    assert not loose, f"engine modules outside the packages {sorted(MAY_IMPORT)}: {loose}"


def test_packages_depend_one_way():
    wrong = []
    for source, target, _, line in edges():
        here, there = package_of(source), package_of(target)
        if here is None:  # the facade (convbias/engine/__init__.py) composes every package
            continue
        if there is None or (there != here and there not in MAY_IMPORT[here]):
            wrong.append(f"{source}:{line} imports {target}")
    assert not wrong, f"imports against {RULE}:\n" + "\n".join(wrong)


def test_no_import_cycle_between_engine_modules():
    graph: dict[str, set[str]] = {}
    for source, target, _, _ in edges():
        graph.setdefault(source, set()).add(target)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_imports_inside_functions_only_where_the_module_says_why():
    """An engine module imports the engine at module level; only the facade defers (so that `train.py --help`
    loads no torch, as its docstring says). A module that defers a third-party import (an optional
    dependency) says why in its docstring, in a sentence naming imports inside functions."""
    modules = engine_modules()
    facade = ast.get_docstring(ast.parse(modules["convbias.engine"].read_text())) or ""
    assert "loads no torch" in facade
    wrong = []
    for name, path in modules.items():
        deferred = [(target, line) for target, inside, line in imports(path) if inside]
        said = "inside functions" in (ast.get_docstring(ast.parse(path.read_text())) or "")
        for target, line in deferred:
            if target.startswith("convbias") and name != "convbias.engine":
                wrong.append(f"{name}:{line} {target} (the engine's own modules: at module level)")
            elif not target.startswith("convbias") and not said:
                wrong.append(f"{name}:{line} {target} (the module's docstring does not say why)")
    assert not wrong, "imports inside functions:\n" + "\n".join(wrong)


@pytest.mark.parametrize("heavy", HEAVY)
def test_config_imports_no_torch(heavy):
    found = [
        f"{m}:{line} {t}"
        for m, p in engine_modules().items()
        if package_of(m) == "config"
        for t, _, line in imports(p)
        if t == heavy or t.startswith(heavy + ".")
    ]
    assert not found, found


def test_the_rule_catches_a_wrong_edge(tmp_path, monkeypatch):
    """The checks above read real files: an import against the rule, written into a copy, is reported."""
    copy = tmp_path / "convbias" / "engine"
    for path in ENGINE.rglob("*.py"):
        target = copy / path.relative_to(ENGINE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    monkeypatch.setattr(sys.modules[__name__], "ENGINE", copy)
    for module, planted, reported in (
        ("config/options.py", "from ..loop import trainer", "config.options:.* imports convbias.engine.loop.trainer"),
        ("rundir/reader.py", "from ..data import datasets", "rundir.reader:.* imports convbias.engine.data.datasets"),
        (
            "checkpoint/manager.py",
            "from ..model import build",
            "checkpoint.manager:.* imports convbias.engine.model.build",
        ),
    ):
        path = copy / module
        original = path.read_text()
        path.write_text(original + f"\n{planted}  # noqa\n")
        with pytest.raises(AssertionError, match=reported):
            test_packages_depend_one_way()
        path.write_text(original)
    test_packages_depend_one_way()  # the copy, its planted edges gone, passes again
