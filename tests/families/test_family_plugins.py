"""Families plug in at one place: no module of the package but convbias/families.py imports a family (imports
inside functions counted), no family imports another, and a planted import fails the rule. A toy family
(tests/toy_family/) plugged in by its name alone, beside `convbias.families.FAMILIES`' (`load_families(names)`, the
result handed to the commands' main), is trained by convbias-train with its diagnostic and reparametrization, drawn
by convbias-diagnostics and exported with its Hub tag under the model name its record gives."""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import yaml
from PIL import Image
from support import REPO
from support.import_graph import edges, modules_under

from convbias import families
from convbias.base.family import Family
from convbias.cli import diagnostics, export, train
from convbias.sharing.hub import run_model

COMPOSITION_ROOT = "convbias.families"
# The console scripts' modules (pyproject's [project.scripts], train.py): the only callers of load_families
ENTRY_POINTS = re.compile(r"train|convbias\.cli\.\w+|convbias\.studies\.\w+\.(command|\w+_command)")
SHIPPED = families.FAMILIES  # the package's own families (the toy family is named beside them below)


def package_modules(root: Path) -> dict[str, Path]:
    found = {"train": root / "train.py"}
    for top in ("convbias", *SHIPPED):
        found.update(modules_under(root / top, root))
    return found


def family_imports(root: Path = REPO) -> list[str]:
    """Every import of a family package from outside it, but the composition root's."""
    found = []
    for source, target, inside, line in edges(package_modules(root), root):
        here, there = source.split(".")[0], target.split(".")[0]
        if there in SHIPPED and here != there and source != COMPOSITION_ROOT:
            where = "inside a function" if inside else "at module level"
            found.append(f"{source}:{line} imports {target} ({where})")
    return found


def test_only_the_composition_root_imports_a_family():
    """What a tool needs from a family comes through convbias.families; a family stands alone."""
    found = family_imports()
    assert not found, "a family is imported outside convbias/families.py (ask convbias.families):\n" + "\n".join(found)


def registrations(root: Path = REPO) -> list[str]:
    """Every call of `load_families` outside an entry point's module: registering the families is the console
    script's explicit call, and what it loads is passed down, never loaded again by a helper."""
    found = []
    for module, path in package_modules(root).items():
        if module == COMPOSITION_ROOT or ENTRY_POINTS.fullmatch(module):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if called == "load_families":
                    found.append(f"{module}:{node.lineno} calls load_families")
    return found


def test_only_the_entry_points_register_the_families():
    found = registrations()
    assert not found, "a helper registers the families (take them from the command instead):\n" + "\n".join(found)


def test_a_planted_registration_in_a_helper_fails(copied_tree):
    root, _ = copied_tree
    target = root / "convbias" / "sharing" / "prediction.py"
    original = target.read_text()
    target.write_text(original + "\n\ndef _planted():\n    load_families()\n")
    try:
        assert registrations(root) == [f"convbias.sharing.prediction:{original.count(chr(10)) + 4} calls load_families"]
    finally:
        target.write_text(original)


@pytest.fixture(scope="module")
def copied_tree(tmp_path_factory):
    """A copy of the package and what the rule finds in it before anything is planted."""
    root = tmp_path_factory.mktemp("tree")
    for top in ("convbias", *SHIPPED):
        shutil.copytree(REPO / top, root / top, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "train.py", root / "train.py")
    return root, family_imports(root)


@pytest.mark.parametrize(
    "module, planted, expected",
    [
        ("convbias/sharing/hub.py", "import convit\n", "convbias.sharing.hub:{line} imports convit (at module"),
        (
            "convbias/cli/diagnostics.py",
            "def _planted():\n    from transformed_cnn import query_maps\n",
            "convbias.cli.diagnostics:{line} imports transformed_cnn (inside a function)",
        ),
        ("efcn/models.py", "import convit.diagnostics\n", "efcn.models:{line} imports convit.diagnostics"),
    ],
)
def test_a_planted_family_import_fails(copied_tree, module, planted, expected):
    """The rule reads real files: an import written into a copy of the package is reported, with its line."""
    root, before = copied_tree
    target = root / module
    original = target.read_text()
    target.write_text(original + "\n" + planted)
    try:
        added = sorted(set(family_imports(root)) - set(before))
    finally:
        target.write_text(original)
    line = original.count("\n") + 1 + planted.count("\n")
    assert len(added) == 1 and added[0].startswith(expected.format(line=line)), added


# -- the toy family -------------------------------------------------------------------------------------------
PLUGGED = (*SHIPPED, "toy_family")  # what a maintainer's one line in FAMILIES makes of them


@pytest.fixture(scope="module")
def plugged() -> families.Families:
    """The families with the toy family's name beside the shipped ones', as every command is handed them."""
    return families.load_families(PLUGGED)


def test_a_family_not_named_is_not_plugged_in(plugged):
    shipped = families.load_families()  # the toy family imported already (its models in timm's registry): not named
    assert "toy_scale" not in shipped.reparametrizations and "toy_scale" in plugged.reparametrizations
    assert list(shipped.records) == list(SHIPPED) and list(plugged.records) == list(PLUGGED)
    assert shipped.hub_tag("toy_family") == "toy_family"  # a package that is no family tags as itself
    assert plugged.hub_tag("toy_family") == "toy-family"


def test_a_name_two_families_give_is_refused(monkeypatch):
    import toy_family

    monkeypatch.setattr(toy_family, "FAMILY", Family(hub_tag="toy", diagnostics={"attention": toy_family.head_norm}))
    with pytest.raises(ValueError, match="family toy_family's diagnostic 'attention': the name is taken"):
        families.load_families(PLUGGED)


@pytest.fixture(scope="module")
def toy_run(plugged, cli_argv, tmp_path_factory):
    """convbias-train of the toy family's model on the embedded digits: reparametrized with its `toy_scale` at
    the start of the second epoch, with its diagnostic logged."""
    run = tmp_path_factory.mktemp("toy") / "run"
    train.run(
        cli_argv(
            cli_argv.PLAIN_DIGITS,
            model="toy_net",
            img_size=8,
            epochs=2,
            batch_size=64,
            train_fraction=0.2,
            reparametrize="toy_scale",
            reparametrize_at_epoch=1,
            reparametrize_kwargs=dict(scale=2.0),
            output=run,
        ),
        plugged,
    )
    return run


@pytest.mark.integration
def test_training_logs_the_toy_familys_diagnostic_and_applies_its_reparametrization(toy_run):
    records = [json.loads(line) for line in (toy_run / "log.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "toy/head_norm" in r]
    assert [r["epoch"] for r in evaluated] == [1, 2]
    assert "toy/scale" not in evaluated[0] and "toy/scale" in evaluated[1]  # from the second epoch on


@pytest.mark.integration
@torch.no_grad()
def test_export_tags_the_toy_family_and_names_its_reparametrized_model(toy_run, plugged, tmp_path):
    out = tmp_path / "exported"
    assert export.main([str(toy_run), "--output", str(out)], plugged) == 0
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["tags"] == ["image-classification", "timm", "toy-family"]
    assert "import toy_family  # registers toy_scaled_toy_net in timm" in card
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "toy_scaled_toy_net" and config["model_args"]["scale"] == 2.0
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert model.scale is not None and model.scale.item() != 2.0  # trained for an epoch after it was added
    trained, _ = run_model(toy_run, plugged)
    images = torch.randn(4, 1, 8, 8)
    assert torch.equal(model(images), trained(images))


@pytest.mark.integration
def test_diagnostics_draws_the_toy_familys_maps(plugged, tmp_path, capsys):
    image = tmp_path / "digit.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (8, 8), dtype=np.uint8)).save(image)
    argv = ["--model", "toy_net", "--image", str(image), "--in-chans", "1", "--img-size", "8"]
    assert diagnostics.main([*argv, "--output", str(tmp_path / "figures")], plugged) == 0
    assert (tmp_path / "figures" / "attention_maps.png").stat().st_size > 0
