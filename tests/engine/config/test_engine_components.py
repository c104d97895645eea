"""The engine's components: options declared once, Config from Python, resume-point parts."""

import dataclasses

import pytest
import torch
import yaml

from convbias import engine
from convbias.base.errors import ConfigError
from convbias.engine import parse_config, validate
from convbias.engine.checkpoint.parts import (
    RunIdentity,
    TrainingProgress,
    continuation_options,
    restore,
    resume_state,
)
from convbias.engine.config.command_line import TIMM_GROUP, build_parser, timm_only_options
from convbias.engine.config.options import SECTIONS, Config, declaration, flag_name, key_value_options
from convbias.engine.config.parsing import coerce
from convbias.families import load_families


def test_every_declared_option_is_on_the_command_line_with_its_default_and_section():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    for title, section in SECTIONS:
        for spec in dataclasses.fields(section):
            assert spec.name in groups[title], (title, spec.name)
            action = actions[spec.name]
            assert flag_name(spec.name) in action.option_strings
            default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
            if spec.name not in key_value_options():  # K=V options are merged with the recipe's key by key
                assert action.default == default, spec.name
    declared = {f.name for f in dataclasses.fields(Config)}
    timm_only = groups[TIMM_GROUP]  # timm's other options, read as its args.yaml keys (engine.config.timm_args)
    assert timm_only == set(timm_only_options()) and not timm_only & declared
    assert set(actions) - {"help"} - timm_only == declared


def test_a_config_built_in_python_equals_the_parsed_command_line(tmp_path):
    argv = ["--model", "convit_tiny", "--lr", "1", "--save-epochs", "1", "2", "--model-kwargs", "depth=2",
            "--epochs", "3", "--output", str(tmp_path / "run")]  # fmt: skip
    parsed = parse_config(argv)
    built = Config(model="convit_tiny", lr=1, save_epochs=[1, 2], model_kwargs={"depth": 2}, epochs=3,
                   output=str(tmp_path / "run"))  # fmt: skip
    validate(built)
    assert built == parsed and isinstance(built.lr, float)
    assert Config.from_dict(yaml.safe_load(yaml.safe_dump(parsed.to_dict()))) == parsed


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("lr", 2, 2.0),
        ("scale", [0, 1], [0.0, 1.0]),
        ("preempt_signals", "SIGTERM SIGUSR1", ["SIGTERM", "SIGUSR1"]),
        ("model_kwargs", [("depth", 2)], {"depth": 2}),
        ("eval_only", "runs/x", "runs/x"),
        ("num_classes", None, None),
    ],
)
def test_values_are_coerced_to_the_declared_type(name, value, expected):
    assert coerce(name, value) == expected


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("epochs", 1.5, "--epochs expects int, got 1.5"),
        ("epochs", None, "--epochs expects int, got None"),
        ("aa", 3, "--aa expects a string, got 3"),
        ("scale", [1], r"--scale expects a list of 2 float values, got \[1\]"),
        ("weight_decay", float("nan"), "--weight-decay must be a finite number, got nan"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_option(name, value, message):
    with pytest.raises(ConfigError, match=message):
        coerce(name, value)


def test_declared_checks_and_unknown_keys_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"--drop-path must be in \[0, 1\), got 1.0"):
        validate(Config(model="convit_tiny", drop_path=1.0, output=str(tmp_path)))
    with pytest.raises(ConfigError, match="unknown --sched 'linear'; choices: cosine, step, constant"):
        validate(Config(model="convit_tiny", sched="linear", output=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"unknown option 'epoch' in run/config.yaml \(did you mean epochs"):
        Config.from_dict({"epoch": 3}, source="run/config.yaml")
    assert declaration("batch_size").metadata["check"].expected == "a positive integer"


@pytest.mark.integration
def test_engine_run_takes_a_config_and_leaves_it_unchanged(tmp_path):
    cfg = Config(
        model="convit_tiny",
        model_kwargs=dict(patch_size=2, depth=2, local_up_to_layer=1, embed_dim=8),
        dataset="digits",
        img_size=8,
        no_aug=True,
        repeated_aug=1,
        train_fraction=0.05,
        epochs=1,
        warmup_epochs=0,
        batch_size=32,
        lr=1e-3,
        workers=0,
        diagnostics=False,
        output=str(tmp_path / "run"),
    )
    before = cfg.to_dict()
    results = engine.run(cfg, load_families())
    assert cfg.to_dict() == before  # validate() normalized a copy (no_aug, output, ...)
    assert results == engine.RunDir(tmp_path / "run").results() and results["epochs"] == 1
    written = engine.RunDir(tmp_path / "run").run_config()
    assert written.model_kwargs == cfg.model_kwargs and written.aa is None  # --no-aug switched it off


def test_resume_parts_declare_the_exact_continuation_options():
    assert continuation_options() == ("model", "model_kwargs", "dataset", "train_fraction", "seed", "batch_size",
                                      "grad_accum_steps", "no_prefetcher", "aa", "reprob", "img_size",
                                      "interpolation")  # fmt: skip


class Counter:
    """A part as a new one would be written: state_dict / load_state_dict."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_a_resume_point_holds_each_parts_state_and_restores_it():
    progress = TrainingProgress(epoch=2, step=5, num_updates=17, loss_sums=[1.5], best={"epoch": 1})
    counter = Counter()
    counter.count = 4
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    optimizer.param_groups[0]["params"][0].grad = torch.ones(2)
    optimizer.step()
    state = resume_state({"identity": RunIdentity("m", {"seed": 0}, False), "progress": progress,
                          "counter": counter, "optimizer": optimizer})  # fmt: skip
    # the layout resume points have always had: progress and identity at the top, other parts by name
    assert state["epoch"] == 2 and state["step"] == 5 and state["model"] == "m" and state["counter"] == {"count": 4}
    fresh, fresh_counter = TrainingProgress(), Counter()
    fresh_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    restore({"progress": fresh, "counter": fresh_counter, "optimizer": fresh_optimizer}, state)
    assert fresh == progress and fresh_counter.count == 4
    assert torch.equal(
        fresh_optimizer.state_dict()["state"][0]["momentum_buffer"],
        optimizer.state_dict()["state"][0]["momentum_buffer"],
    )


def test_a_training_state_written_before_the_parts_existed_loads():
    """The flat dict the engine wrote before (keys as they were), including a key the parts no longer know."""
    legacy = {
        "model": "convit_tiny",
        "options": {"model": "convit_tiny", "seed": 0},
        "epoch": 3,
        "step": 0,
        "loss_sums": [0.0],
        "initial_diagnostics": {},
        "num_updates": 30,
        "best": {"epoch": 2, "eval_top1": 50.0},
        "final": {"epoch": 3, "eval_top1": 40.0},
        "reparametrized": False,
        "sharded": False,
        "optimizer": None,
        "scheduler": {},
        "scaler": None,
        "rng": [],
    }
    progress = TrainingProgress()
    restore({"progress": progress}, legacy)
    assert (progress.epoch, progress.num_updates, progress.best["eval_top1"]) == (3, 30, 50.0)


def test_the_trainer_hands_its_manager_every_part_a_point_holds(tmp_path, deit_recipe):
    """The parts the trainer hands its checkpoint manager: the run's identity with the continuation options' values,
    its progress, optimizer, schedule, random streams and (the DeiT recipe's device-side augmentation) the device
    augmentation's streams; fp32 on a CPU: no grad scaler."""
    from convbias.engine.loop.start import start_run
    from convbias.engine.loop.trainer import build_trainer

    options = dict(
        model="convit_tiny",
        model_kwargs=dict(patch_size=2, depth=2, local_up_to_layer=1, embed_dim=8),
        dataset="digits",
        img_size=8,
        repeated_aug=1,
        epochs=1,
        batch_size=16,
        workers=0,
        diagnostics=False,
        output=str(tmp_path / "run"),
    )
    cfg = Config(**{**deit_recipe, **options})  # fmt: skip  (the DeiT recipe: device-side augmentation)
    validate(cfg)
    trainer = build_trainer(start_run(cfg, load_families(), None))
    parts = trainer.checkpointer.parts
    assert list(parts) == ["identity", "progress", "optimizer", "scheduler", "rng", "augment"]
    assert parts["progress"] is trainer.progress and parts["augment"].augment is trainer.data.augment
    assert parts["scheduler"].optimization is trainer.optimization
    assert parts["identity"].options == {key: getattr(cfg, key) for key in continuation_options()}
