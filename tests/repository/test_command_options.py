"""Every console script's options are declared with their checks, and a value they refuse is one line and exit 2
before any work: out of range, NaN or infinite, not a number, not one of the names a closed set holds, or a
device this machine does not have. The bad values are derived from each command's own declarations (its
argparse actions' declared types and choices; train.py's option declarations), so a new option is covered as
it is added; a number option declared without a check fails here."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import typing

import pytest
import timm
import tomllib
import torch
from PIL import Image
from support import REPO

from convbias.base import storage
from convbias.base.command_line import DEVICE, Typed, key_value, literal_key_value
from convbias.base.devices import check_device, default_device
from convbias.base.errors import EXIT_USAGE, ConfigError
from convbias.engine.config.options import Config, declaration, flag_name, option_types

SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
TRAIN = "convbias-train"
# numbers a rule is tried on: a declared range refuses some of them
CANDIDATES = [-(2**40), -1, 0, 1, 2, 3, 255, 256, 2**16, 2**31, 2**32, 2**40]
FLOAT_CANDIDATES = [-0.5, 0.25, 0.5, 1.5, 255.5]


def module_of(script: str):
    return importlib.import_module(SCRIPTS[script].split(":")[0])


def parsers(script: str) -> list[tuple[list[str], argparse.ArgumentParser]]:
    """(the argv that reaches it, the parser) of a command and of each of its sub-commands."""
    top = module_of(script).build_parser()
    found = [([], top)]
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [([name], sub) for name, sub in action.choices.items()]
    return found


def required_argv(parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Placeholders for the arguments a parser requires: (before the options, after them: the positional
    arguments of a parser whose last takes the REMAINDER, a launcher's script and its arguments)."""
    before, after = [], []
    remainder = any(action.nargs == argparse.REMAINDER for action in parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        if not action.option_strings and action.nargs not in ("?", "*"):
            (after if remainder else before).append("PLACEHOLDER")
        elif action.option_strings and action.required:
            before += [action.option_strings[0], "PLACEHOLDER"]
    return before, after


def refused_numbers(kind: type, rule, count: int | None = None) -> list[str]:
    """The candidates ``rule`` refuses (as ``count`` equal values of a list option's rule, given a count)."""
    candidates = CANDIDATES + (FLOAT_CANDIDATES if kind is float else [])
    value = (lambda v: [kind(v)] * count) if count else kind
    return [str(v) for v in candidates if rule is not None and not rule.valid(value(v))]


def bad_values(action: argparse.Action) -> list[str]:
    """What the action's declaration refuses: not a number, NaN, infinite, out of its range, a name outside its
    choices or its rule, a device this machine lacks."""
    kind = action.type
    values = []
    if isinstance(kind, Typed) and kind.kind in (int, float):
        values += ["abc", "nan", "inf", *refused_numbers(kind.kind, kind.rule)]
    elif kind in (key_value, literal_key_value):  # YAML's NaN and infinity; a Python literal's infinity
        values += ["key=.nan", "key=.inf", *(["key=1e999"] if kind is literal_key_value else [])]
    elif isinstance(kind, Typed) and kind.rule is not None and not kind.rule.valid("bogus"):
        values.append("bogus")
    elif kind is DEVICE:
        values += ["bogus", f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"]
    if action.choices:
        numbers = [c for c in action.choices if isinstance(c, int)]
        values.append(str(max(numbers) + 1) if numbers else "bogus")
    return list(dict.fromkeys(values))


def option_cases() -> list[tuple[str, list[str], str, str, int]]:
    """(script, argv before the option, the option's flag, a bad value, its count of values) of every command."""
    cases = []
    for script in sorted(set(SCRIPTS) - {TRAIN}):
        for prefix, parser in parsers(script):
            for action in parser._actions:
                if not action.option_strings or action.nargs == 0 or action.dest == "help":
                    continue
                count = action.nargs if isinstance(action.nargs, int) else 1
                for value in bad_values(action):
                    cases.append((script, prefix, action.option_strings[0], value, count))
    return cases


def test_every_command_declares_its_number_options_with_their_checks():
    """A number option parsed by a bare int or float would take NaN, infinity or any range unchecked."""
    scripts = sorted(set(SCRIPTS) - {TRAIN})
    bare = [
        f"{script} {' '.join(prefix)} {action.option_strings[0]}"
        for script in scripts
        for prefix, parser in parsers(script)
        for action in parser._actions
        if action.type in (int, float)
    ]
    assert not bare, f"number options without a declared check (engine.config.command_line.Typed): {bare}"
    kinds = {script: {type(a.type) for _, p in parsers(script) for a in p._actions} for script in scripts}
    assert all(Typed in kinds[s] for s in ("convbias-robustness", "convbias-stability", "convbias-launch"))


@pytest.fixture
def no_work(monkeypatch, tmp_path):
    """Any model built, weights read or image opened is a bug of the check (raised as one, with its traceback);
    the command runs in an empty folder that must stay empty."""

    def work(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(timm, "create_model", work)
    monkeypatch.setattr(torch, "load", work)
    monkeypatch.setattr(Image, "open", work)
    monkeypatch.chdir(tmp_path)

    class NoWeightsRead(storage.FileSystem):
        load_safetensors = staticmethod(work)

    with storage.using(NoWeightsRead()):
        yield
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("script", "prefix", "flag", "value", "count"), option_cases())
def test_a_refused_value_is_one_line_and_exit_2_before_any_work(no_work, capsys, script, prefix, flag, value, count):
    parser = {tuple(p): q for p, q in parsers(script)}[tuple(prefix)]
    before, after = required_argv(parser)
    argv = [*prefix, *before, flag, *[value] * count, *after]
    assert module_of(script).main(argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    names = next(a.option_strings for a in parser._actions if flag in a.option_strings)
    assert out == "" and err.count("\n") == 1 and err.startswith("error: argument "), err
    assert any(name in err.split(":")[1] for name in names) and value in err, err


def train_declarations() -> list[tuple[str, type, typing.Any, tuple | None, int | None]]:
    """(option, its value type, its check, its choices, its count of values for a list) of every typed option
    of train.py."""
    found = []
    for spec in dataclasses.fields(Config):
        kind = option_types()[spec.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if type(None) in typing.get_args(kind) and len(args) == 1 else kind  # X | None: X
        listed = typing.get_origin(kind) is list
        item = typing.get_args(kind)[0] if listed else kind
        count = (spec.metadata["nargs"] if isinstance(spec.metadata["nargs"], int) else 1) if listed else None
        if item in (int, float, str):
            found.append((spec.name, item, spec.metadata["check"], spec.metadata["choices"], count))
    return found


def train_argv(name: str, value: str) -> list[str]:
    nargs = declaration(name).metadata["nargs"]
    return [flag_name(name), *[value] * (nargs if isinstance(nargs, int) else 1)]


def named(kind: type, check, choices) -> bool:
    """Whether an option takes names from a closed set: choices, or a string rule that refuses 'bogus'."""
    return bool(choices) or (kind is str and check is not None and not check.valid("bogus"))


def refused_by_train(capsys, argv: list[str]) -> str:
    from convbias.cli import train

    assert train.main(["--model", "resnet10t", *argv]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_train_refuses_nan_range_and_names_of_every_declared_option_in_one_line(no_work, capsys):
    """All at once: each refused option named in the one line (the checks name every refusal)."""
    declared = train_declarations()
    ranged = [(n, refused_numbers(k, c, count)) for n, k, c, _, count in declared if k is not str]
    rounds = {
        "NaN": [(n, "nan") for n, kind, *_ in declared if kind is float],
        "infinity": [(n, "inf") for n, kind, *_ in declared if kind is float],
        "range": [(n, refused[0]) for n, refused in ranged if refused],
        "name": [(n, "bogus") for n, kind, check, choices, _ in declared if named(kind, check, choices)],
    }
    assert len(rounds["range"]) > 40 and {"interpolation", "aa", "sched"} <= {n for n, _ in rounds["name"]}
    for kind, bad in rounds.items():
        err = refused_by_train(capsys, [arg for name, value in bad for arg in train_argv(name, value)])
        missing = [name for name, _ in bad if flag_name(name) not in err]
        assert not missing, f"{kind}: {missing} not named in {err}"


def test_train_refuses_a_non_number_for_every_int_option(no_work, capsys):
    for name in [n for n, kind, *_ in train_declarations() if kind is int]:
        err = refused_by_train(capsys, train_argv(name, "nan"))
        assert f"argument {flag_name(name)}" in err, err


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("convbias-robustness", ["RUN", "--eps", "nan"], "argument --eps: must be a finite number, got nan"),
        ("convbias-robustness", ["RUN", "--device", "bogus"], "argument --device: expected cpu, cuda or cuda:N"),
        ("convbias-stability", ["RUN", "--device", "bogus"], "argument --device: expected cpu, cuda or cuda:N"),
        ("convbias-predict", ["RUN", "x.png", "--device", "bogus"], "argument --device: expected cpu, cuda or cuda:N"),
    ],
)
def test_the_cases_of_the_issue_are_one_line(no_work, capsys, script, argv, message):
    assert module_of(script).main(argv) == EXIT_USAGE
    assert capsys.readouterr().err.startswith(f"error: {message}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("script", ["convbias-robustness", "convbias-stability", "convbias-predict"])
def test_cuda_on_a_machine_without_one_is_refused(no_work, capsys, script):
    argv = ["RUN", *(["x.png"] if script == "convbias-predict" else []), "--device", "cuda"]
    assert module_of(script).main(argv) == EXIT_USAGE
    assert capsys.readouterr().err == "error: argument --device: cuda: no CUDA device is available here (use cpu)\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--interpolation", "bogus"], "unknown --interpolation 'bogus'; choices: '', bilinear, bicubic"),
        (["--aa", "bogus"], "--aa bogus: unknown policy 'bogus'; timm's: rand-..., augmix-..., original"),
        (["--aa", "rand-m9-n-3"], "--aa rand-m9-n-3: section 'n' is not one of the rand policy's sections"),
        (["--aa", "rand-m9-tbogus"], "section 'tbogus': the transform set is one of weights, 3aw, 3a"),
        (["--model-kwargs", "drop_rate=1e999"], "drop_rate=1e999: the value must be a finite number, got inf"),
    ],
)
def test_train_names_from_a_closed_set_are_parsed_before_any_work(no_work, capsys, argv, message):
    assert message in refused_by_train(capsys, argv)


def test_a_run_config_with_an_unknown_name_is_refused_for_eval_only(no_work, tmp_path, capsys):
    """--eval-only RUN takes the run's interpolation: a config.yaml naming none of timm's is a damaged run file."""
    from convbias.cli import train

    run = tmp_path / "run"
    run.mkdir()
    for key, value in (("interpolation", "bogus"), ("aa", "rand-m9-n-3")):
        (run / "config.yaml").write_text(f"model: resnet10t\n{key}: {value}\n")
        assert train.main(["--eval-only", str(run)]) == 65
        err = capsys.readouterr().err
        assert err.startswith(f"error: {run / 'config.yaml'}: {key}: ") and err.count("\n") == 1, err
        assert value in err
    (run / "config.yaml").write_text("model: resnet10t\nlr: 0.1\nlr: 0.2\n")
    assert train.main(["--eval-only", str(run)]) == 65
    assert capsys.readouterr().err == (
        f"error: run config {run / 'config.yaml'} is not valid YAML: the key 'lr' is given twice, on lines 2 and 3\n"
    )
    for path in run.iterdir():
        path.unlink()
    run.rmdir()


def test_values_probe_what_their_declarations_refuse():
    """The derivation itself: a range refuses what is outside it, NaN and infinity are refused by every number."""
    seed = declaration("seed").metadata["check"]
    assert refused_numbers(int, seed) == [str(-(2**40)), "-1", str(2**31), str(2**32), str(2**40)]
    assert bad_values(next(a for a in module_of("convbias-predict").build_parser()._actions if a.dest == "device"))
    for text in ("nan", "inf", "1e999"):
        with pytest.raises(argparse.ArgumentTypeError, match="finite"):
            Typed(float)(text)
    assert math.isclose(Typed(float)("0.5"), 0.5)


def test_devices_are_checked_against_this_machine():
    assert check_device("cpu") == "cpu"
    for name in ("cpu:0", "tpu", "cuda:x", ""):
        with pytest.raises(ConfigError, match=r"expected cpu, cuda or cuda:N"):
            check_device(name)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match="no CUDA device" if count == 0 else "CUDA device"):
        check_device(f"cuda:{count}")
    assert default_device() == ("cuda" if count else "cpu")
