"""Every run-directory name comes from base.run_layout: read from the source of convbias/, train.py
and benchmarks/, no other module spells one. A file name (config.yaml, model.safetensors, ...) is refused as
a string constant anywhere but in a docstring; a name that is also a word of the code (``checkpoints``,
``last``, ``best``, ``sharded``, ``wandb``, ``init``) is refused where it is joined into a path (``path / "last"``); any name is
refused as a component of a slash-separated path string, and ``epoch_`` where a string builds a point or
snapshot name (``f"epoch_{n}"``)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from support import REPO

from convbias.base import run_layout as layout

ROOT = REPO
SOURCES = ("convbias", "train.py", "benchmarks")
LAYOUT = ROOT / "convbias" / "base" / "run_layout.py"
FILE_NAMES = {
    layout.CONFIG_FILE,
    layout.TIMM_ARGS_FILE,
    layout.SUMMARY_FILE,
    layout.LOG_FILE,
    layout.RESULTS_FILE,
    layout.LOCK_FILE,
    layout.WEIGHTS_FILE,
    layout.EMA_FILE,
    layout.STATE_FILE,
    layout.MANIFEST_FILE,
    layout.SNAPSHOTS_FILE,
    layout.SHARDED_METADATA,
    layout.STAGING_GLOB,
}
WORDS = {layout.CHECKPOINTS_DIR, *layout.LINKS, layout.SHARDED_DIR, layout.TRACKER_DIR, layout.INIT_SNAPSHOT}
POINT_PREFIX = "epoch_"  # how point and snapshot names begin (layout.point_name, layout.snapshot_name)


def source_files() -> list[Path]:
    files = []
    for name in SOURCES:
        path = ROOT / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [f for f in files if f != LAYOUT]


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def literals(path: Path) -> list[str]:
    """'file:line "name"' for every spelling of a layout name in ``path``."""
    tree = ast.parse(path.read_text())
    skip = docstrings(tree)
    joined = {id(n.right) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)}
    joined |= {id(n.left) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)}
    building = {
        id(n.values[0])
        for n in ast.walk(tree)
        if isinstance(n, ast.JoinedStr) and n.values and isinstance(n.values[0], ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in skip:
            continue
        value = node.value
        parts = value.split("/") if "/" in value else []
        wrong = (
            value in FILE_NAMES
            or (id(node) in joined and value in WORDS)
            or any(part in FILE_NAMES | WORDS for part in parts)
            or (id(node) in building and value.split("/")[-1] == POINT_PREFIX)
        )
        if wrong:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {value!r}")
    return found


def test_run_directory_names_come_from_the_layout_module():
    found = [line for path in source_files() for line in literals(path)]
    assert not found, "run-directory names spelled outside base/run_layout.py:\n" + "\n".join(found)


def test_the_layout_names_what_it_promises():
    """What the check above looks for are the names train.py writes (a renamed file would go unchecked)."""
    assert layout.RUN_FILES == (
        layout.CONFIG_FILE,
        layout.TIMM_ARGS_FILE,
        layout.SUMMARY_FILE,
        layout.LOG_FILE,
        layout.RESULTS_FILE,
        layout.LOCK_FILE,
        layout.CHECKPOINTS_DIR,
        layout.TRACKER_DIR,
    )
    assert layout.point_name(7, 120) == "epoch_0007_step_0000120"
    assert layout.point_position(Path("epoch_0007")) == (7, 0)
    assert layout.snapshot_file(5) == "epoch_5.safetensors" and layout.snapshot_epoch(layout.INIT_SNAPSHOT) == 0


@pytest.mark.parametrize(
    "planted",
    [
        'NAME = "training_state.pt"\n',
        'def f(run):\n    return run / "best"\n',
        'def f(run):\n    return f"{run}/checkpoints/{run}"\n',
        'def f(epoch):\n    return f"epoch_{epoch}"\n',
    ],
)
def test_the_check_catches_a_planted_literal(tmp_path, monkeypatch, planted):
    """The check reads real files: a name spelled into a copy of a module is reported."""
    target = tmp_path / "convbias" / "sharing" / "hub.py"
    target.parent.mkdir(parents=True)
    target.write_text((ROOT / "convbias" / "sharing" / "hub.py").read_text() + "\n\n" + planted)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SOURCES", ("convbias",))
    with pytest.raises(AssertionError, match=r"convbias/sharing/hub.py:\d+ "):
        test_run_directory_names_come_from_the_layout_module()
