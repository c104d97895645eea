"""The studies' own modules, called directly: the eFCN protocol's schedule and recipe
(convbias.studies.efcn_protocol.protocol) against closed forms and timm's optimizer factory, the keys of its
config file and the phase diagram's (convbias.studies.phase_diagram.study) checked as declared, the robustness
study (convbias.studies.robustness.study) against the accuracy of the bare model on the same images, and the
runs a sweep's report reads (convbias.studies.sweep.runs) against the rows written."""

from __future__ import annotations

import json
import math
import re
import typing

import pytest
import timm
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import save_file
from timm.optim import create_optimizer_v2

from convbias.base.tables import write_csv
from convbias.engine import Config, ConfigError, build_datasets
from convbias.engine.config.parsing import dataclass_declarations
from convbias.families import load_families
from convbias.studies.efcn_protocol import protocol
from convbias.studies.phase_diagram import study as phase_diagram
from convbias.studies.robustness.study import RobustnessOptions, RobustnessStudy, evaluate
from convbias.studies.sweep import runs

pytestmark = pytest.mark.usefixtures("single_thread", "registered")


@pytest.fixture(scope="module")
def registered():
    """The families' models in timm's registry, as each study's command registers them before it reads a config."""
    load_families()


# -- the eFCN protocol ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "epochs, k, times",
    [
        (16, 6, [0, 1, 2, 4, 8, 16]),  # 1..16 in 5 log-spaced steps: the powers of 2
        (150, 2, [0, 150]),  # the initialization and the trained CNN
        (3, 6, [0, 1, 2, 3]),  # more relax times than epochs: duplicates moved up, none past the end
    ],
)
def test_relax_times_are_the_initialization_and_log_spaced_epochs(epochs, k, times):
    assert protocol.relax_times(epochs, k) == times


def test_the_config_is_the_defaults_with_the_files_keys_and_the_given_options(tmp_path):
    path = tmp_path / "protocol.yaml"
    path.write_text("cnn_epochs: 4\nsnapshots: 3\n")
    cfg = protocol.load_config(str(path), {"efcn_epochs": 2, "seed": None})  # None: not given
    assert cfg == dict(protocol.DEFAULTS, cnn_epochs=4, snapshots=3, efcn_epochs=2)
    path.write_text("cnn_epochs: 4\ncnn_epoch: 4\n")
    with pytest.raises(ConfigError, match=rf"^protocol config {path}, line 2: cnn_epoch: unknown key \(did you mean"):
        protocol.load_config(str(path), {})
    for overrides, message in (
        ({"snapshots": 1}, "snapshots must be >= 2"),
        ({"optimizer": "sgdm"}, "optimizer: unknown value 'sgdm'; choices: sgd, adam"),
        ({"cnn_epochs": 0}, "cnn_epochs must be a positive integer, got 0"),
        ({"model": "resnet18"}, "model efcn_resnet18 is not registered"),
    ):
        with pytest.raises(ConfigError, match=message):
            protocol.load_config(None, overrides)


# numbers a declared range is tried on: each declaration refuses some of them
CANDIDATES = [-(2**40), -1, 0, 1, 2, 9, 10, 64, 65, 1700, 1701, 2**31, 2**40]


def refused_values(spec) -> list:
    """What a file key's declaration refuses, derived from it: another type, NaN and infinity where a number
    goes, the candidates its check refuses, a name outside its choices."""
    optional = type(None) in typing.get_args(spec.kind)
    kind = next(a for a in typing.get_args(spec.kind) if a is not type(None)) if optional else spec.kind
    item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
    refused = lambda values: [v for v in values if spec.check is not None and not spec.check.valid(v)]  # noqa: E731
    if kind is int:
        return ["abc", 1.5, True, *refused(CANDIDATES)]
    if kind is float:
        return ["abc", math.nan, math.inf, *refused([float(c) for c in CANDIDATES])]
    if item in (int, float):
        lists = [[item(c)] * 2 for c in CANDIDATES]
        return [3, ["abc"], [math.nan] if item is float else [1.5], *([[]] if refused([[]]) else []), *refused(lists)]
    if typing.get_origin(kind) is dict:
        return [3, {"channels": math.nan}]
    assert kind is str, kind
    return [3, *(["bogus"] if spec.choices else [])]


def file_cases(declared: dict) -> list[tuple[str, object]]:
    cases = [(key, value) for key, spec in declared.items() for value in refused_values(spec)]
    assert {key for key, _ in cases} == set(declared), "a key whose declaration refuses nothing"
    return cases


@pytest.mark.parametrize(("key", "value"), file_cases(protocol.DECLARED))
def test_each_key_of_a_protocol_config_is_checked_naming_the_file_line_and_key(tmp_path, key, value):
    """Derived from the declarations: a protocol config's value of another type, NaN, infinite, out of range or
    not one of a closed set is one ConfigError naming the file, the line and the key, before any work."""
    path = tmp_path / "protocol.yaml"
    path.write_text("# a protocol config\n" + yaml.safe_dump({key: value}))
    with pytest.raises(ConfigError) as refused:
        protocol.load_config(str(path), {})
    message = str(refused.value)
    assert re.match(rf"protocol config {re.escape(str(path))}, line 2: {key}[ :]", message) and "\n" not in message


def test_the_protocol_declares_every_key_its_defaults_and_files_pass(repo):
    assert list(protocol.DECLARED) == list(protocol.DEFAULTS)
    assert protocol.load_config(None, {}) == protocol.DEFAULTS
    for path in sorted((repo / "configs" / "efcn_protocol").glob("*.yaml")):
        protocol.load_config(str(path), {})


@pytest.mark.parametrize(("key", "value"), file_cases(dataclass_declarations(phase_diagram.PhaseDiagramConfig)))
def test_each_key_of_a_phase_diagram_config_is_checked_naming_the_file_line_and_key(tmp_path, key, value):
    path = tmp_path / "grid.yaml"
    path.write_text("# a phase-diagram config\n" + yaml.safe_dump({key: value}))
    with pytest.raises(ConfigError) as refused:
        phase_diagram.PhaseDiagramConfig.from_yaml(path)
    message = str(refused.value)
    assert re.match(rf"phase-diagram config {re.escape(str(path))}, line 2: {key}[ :]", message), message
    assert "\n" not in message


def test_the_phase_diagrams_defaults_and_files_pass_their_declarations(repo):
    assert phase_diagram.PhaseDiagramConfig().validated() == phase_diagram.PhaseDiagramConfig()
    for path in sorted((repo / "configs" / "phase_diagram").glob("*.yaml")):
        phase_diagram.PhaseDiagramConfig.from_yaml(path)


def test_the_recipes_sgd_is_plain_sgd_in_timms_optimizer_factory():
    """Sec. 6.2.2 trains with SGD without momentum or weight decay: timm's "momentum" with momentum 0 (timm's
    "sgd" is Nesterov's, which refuses momentum 0)."""
    recipe = protocol.train_recipe(dict(protocol.DEFAULTS))
    model = torch.nn.Linear(4, 2)
    optimizer = create_optimizer_v2(
        model, opt=recipe.opt, lr=0.1, momentum=recipe.momentum, weight_decay=recipe.weight_decay
    )
    assert type(optimizer) is torch.optim.SGD
    assert {k: optimizer.defaults[k] for k in ("momentum", "nesterov", "weight_decay", "dampening")} == dict(
        momentum=0.0, nesterov=False, weight_decay=0.0, dampening=0
    )
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        create_optimizer_v2(model, opt="sgd", lr=0.1, momentum=0.0)
    assert (recipe.no_aug, recipe.sched, recipe.warmup_epochs, recipe.batch_size) == (True, "constant", 0, 250)
    assert protocol.train_recipe(dict(protocol.DEFAULTS, optimizer="adam")).opt == "adam"


# -- the robustness study -------------------------------------------------------------------------------------
MODEL_KWARGS = dict(channels=4)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A VanillaCNN on the native 8x8 digits: its initialization and the same after 40 steps of Adam."""
    folder = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    bundle = build_datasets(Config(dataset="digits", img_size=8, no_aug=True))
    model = timm.create_model("vanilla_cnn", num_classes=10, in_chans=1, img_size=8, **MODEL_KWARGS)
    save_file(model.state_dict(), folder / "untrained.safetensors")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(
        bundle.train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    for _, (images, labels) in zip(range(40), loader):
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    save_file(model.state_dict(), folder / "trained.safetensors")
    return folder


def bare_accuracy(path, bundle) -> float:
    """Top-1 in percent of the model with these weights on the normalized validation images, without the
    study's pixel-space wrapper or loaders."""
    from safetensors.torch import load_file

    model = timm.create_model("vanilla_cnn", num_classes=10, in_chans=1, img_size=8, **MODEL_KWARGS)
    model.load_state_dict(load_file(path))
    images = torch.stack([bundle.val[i][0] for i in range(len(bundle.val))])
    labels = torch.tensor([int(bundle.val[i][1]) for i in range(len(bundle.val))])
    with torch.no_grad():
        return 100.0 * (model.eval()(images).argmax(1) == labels).sum().item() / len(labels)


def test_the_study_measures_each_models_clean_accuracy_as_the_bare_model_scores(weights, tmp_path):
    options = RobustnessOptions(
        model="vanilla_cnn",
        checkpoint=str(weights / "trained.safetensors"),
        model_kwargs=MODEL_KWARGS,
        compare_model="vanilla_cnn",
        compare_checkpoint=str(weights / "untrained.safetensors"),
        compare_model_kwargs=MODEL_KWARGS,
        img_size=8,
        attacks=[],
        corruptions=[],
        workers=0,
        output=str(tmp_path / "report"),
    )
    study = RobustnessStudy(options)
    assert list(study.models) == ["vanilla_cnn (trained)", "vanilla_cnn (untrained)"]  # told apart by weights
    assert study.baseline == "vanilla_cnn (untrained)"
    result = evaluate(study, progress=lambda message: None)
    expected = [bare_accuracy(weights / f"{name}.safetensors", study.bundle) for name in ("trained", "untrained")]
    assert [row["clean"] for row in result["table"]] == pytest.approx(expected, abs=1e-9)
    assert expected[0] > expected[1] + 10  # two different models: the rows are not interchangeable
    written = json.loads((tmp_path / "report" / "robustness.json").read_text())
    assert written["table"] == result["table"] and written["settings"]["img_size"] == 8


def test_a_class_list_of_another_size_is_refused_before_any_model_is_built(weights, tmp_path):
    (tmp_path / "classes.txt").write_text("\n".join(f"c{i}" for i in range(5)) + "\n")
    options = RobustnessOptions(
        model="vanilla_cnn",
        checkpoint=str(tmp_path / "not_there.safetensors"),  # never read
        img_size=8,
        imagenet_classes=str(tmp_path / "classes.txt"),
    )
    with pytest.raises(ConfigError, match="names 5 classes, the model has 10 .--dataset digits."):
        RobustnessStudy(options)


# -- the runs of a sweep --------------------------------------------------------------------------------------
def run_row(variant: str, model: str, fraction: float, seed: int, strength: float, top1: float) -> dict:
    """A row as Sweep.collect writes it: grid values, then results.json's and the training time."""
    return dict(
        run=f"{variant}-f{fraction}-ls{strength}-s{seed}",
        variant=variant,
        model=model,
        train_fraction=fraction,
        seed=seed,
        locality_strength=strength,
        top1=top1,
        best_top1=top1 + 1.0,
        best_epoch=3,
        epochs_trained=4,
        train_seconds=12.5,
    )


ROWS = [
    run_row(variant, model, fraction, seed, strength, 40.0 + 10 * seed + 0.25)
    for variant, model in (("convit", "convit_tiny"), ("deit", "deit_tiny_plus"))
    for fraction in (0.5, 0.1)
    for strength in (1.0, 2.0)
    for seed in (0, 1)
]


def test_the_runs_read_back_as_written_numbers_parsed(tmp_path):
    rows = [dict(ROWS[0], top5=None), *ROWS[1:]]  # a result a run did not have: an empty cell, dropped
    write_csv(rows, tmp_path / "runs.csv")
    assert runs.read_runs(tmp_path / "runs.csv") == ROWS
    for content, message in (("", "holds no rows"), ("run,top1\na,1\n", "has no 'model' column")):
        (tmp_path / "bad.csv").write_text(content)
        with pytest.raises(ValueError, match=message):
            runs.read_runs(tmp_path / "bad.csv")
    with pytest.raises(ValueError, match="CSV not found"):
        runs.read_runs(tmp_path / "missing.csv")


def test_the_columns_settings_and_groups_of_the_runs():
    assert runs.compared_column(ROWS) == "variant"
    assert runs.compared_column([{k: v for k, v in row.items() if k != "variant"} for row in ROWS]) == "model"
    assert runs.parameter_columns(ROWS) == ["locality_strength"]  # the one swept factor
    assert runs.train_fractions(ROWS) == [0.1, 0.5]
    assert runs.column_values(ROWS, "locality_strength") == [1.0, 2.0]
    groups = runs.group_runs(ROWS, ["variant", "locality_strength"])
    assert [where for where, _ in groups] == [
        {"variant": v, "locality_strength": s} for v in ("convit", "deit") for s in (1.0, 2.0)
    ]
    for where, selected in groups:
        assert selected == [row for row in ROWS if all(row[k] == v for k, v in where.items())]
        assert len(selected) == 4  # 2 fractions x 2 seeds
    assert runs.group_runs(ROWS, []) == [({}, ROWS)]
    assert runs.select_runs(ROWS, variant="deit", seed=1, train_fraction=0.1, locality_strength=2.0) == [ROWS[-1]]


def test_the_baseline_is_the_deit_unless_named():
    assert runs.choose_baseline(ROWS) == "deit"
    assert runs.choose_baseline(ROWS, "convit") == "convit"
    with pytest.raises(ValueError, match=r"baseline 'vit' is not in the CSV's variant column \['convit', 'deit'\]"):
        runs.choose_baseline(ROWS, "vit")
    two_deits = ROWS + [dict(ROWS[0], variant="deit_b")]
    with pytest.raises(ValueError, match="cannot tell the baseline among"):
        runs.choose_baseline(two_deits)


def test_labels_of_settings_fractions_and_metrics():
    assert runs.fraction_label(0.05) == "5%" and runs.fraction_label(1.0) == "100%"
    assert runs.metric_label("best_top1") == "best top-1"
    assert runs.setting_title({"width": 8, "alpha": 1}) == "width=8, alpha=1"
