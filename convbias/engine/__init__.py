"""The training engine: config, rundir, data, model, optim, checkpoint, loop. It names no model family.

``run(cfg_or_argv, extensions)`` trains (or evaluates) one run and raises the package's errors
(``convbias.base.errors``: a user's mistake, a damaged input, a failed write, a divergence, an interruption, a
preemption); the command line (``convbias.cli.train``) reports them as one line and an exit code. The models
come from timm's registry and the family-specific pieces from ``extensions`` (``convbias.families`` builds
both; ``train.py`` composes them).

``parse_config(argv)`` and ``validate(cfg)`` are the one way options are checked: the config package reads
and checks them, then every package checks the options it owns (``check_packages``), and the Config is
frozen. The packages are imported inside functions here, after the command line is parsed, so that
``train.py --help`` loads no torch; no other engine module imports the engine inside a function.
"""

from __future__ import annotations

import importlib
import os
from functools import partial
from typing import Any

from convbias.base.errors import (
    ConfigError,
    DamagedCheckpointError,
    DamagedFileError,
    DamagedRunRecordError,
    Interrupted,
    NonFiniteLossError,
    StorageError,
    print_error,
)
from convbias.base.storage import storage_reason, write_failure

from .config import parsing as config_parsing
from .config.options import Config
from .config.parsing import config_warnings
from .loop.extensions import Extensions

# What torch's env:// rendezvous reads: a launcher (torchrun, accelerate launch, convbias-launch) sets each of them
# in every process it starts, with LOCAL_RANK
_RENDEZVOUS_VARIABLES = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")

# The engine's public API, each name documented in docs/engine.md: what the console scripts, studies, sharing and
# evaluation import. Beyond run, names are loaded from their submodule on first use (PEP 562
# `__getattr__`), to keep start-up time low: the model, data and checkpoint modules import timm and
# accelerate, which `--help` does not need. No module outside the engine imports its submodules
# (tests/repository/test_package_imports.py): a name the rest of the package needs is added here.
_SUBMODULE_OF = {
    **dict.fromkeys(("Config", "DEFAULT_WHICH", "WHICH"), "config.options"),
    **dict.fromkeys(("RunCheckpoint", "RunDir"), "rundir.reader"),
    **dict.fromkeys(("is_run_dir",), "rundir.run_files"),
    **dict.fromkeys(("build_datasets",), "data.factory"),
    **dict.fromkeys(("build_eval_loader",), "data.loaders"),
    **dict.fromkeys(("DATASETS", "ImageFolderDataset"), "data.datasets"),
    **dict.fromkeys(("check_model_name", "create_model"), "model.factory"),
    **dict.fromkeys(("OutputScale",), "model.output_scale"),
    **dict.fromkeys(("build_run_model", "create_timm_model", "run_model_spec"), "model.build"),
    **dict.fromkeys(("read_log", "read_summary"), "loop.records"),
    **dict.fromkeys(("compile_model",), "model.compile"),
    # what the console scripts, studies and the sharing package build on: train.py's parser and the declared
    # options' checks and readers (for options of their own declared as train.py's are), the run files and
    # timm checkpoints they read, the run's input format and evaluation transform
    **dict.fromkeys(("build_parser", "declared"), "config.command_line"),
    **dict.fromkeys(
        ("AT_LEAST_ONE", "Check", "FRACTION", "NON_NEGATIVE", "POSITIVE", "POSITIVE_INT"), "config.options"
    ),
    **dict.fromkeys(("declaration", "option", "option_names"), "config.options"),
    **dict.fromkeys(
        (
            "Declared",
            "dataclass_declarations",
            "declared_value",
            "file_option_value",
            "file_place",
            "read_declared_yaml",
            "train_option",
        ),
        "config.parsing",
    ),
    **dict.fromkeys(("WRITE_ERRORS",), "checkpoint.points"),
    **dict.fromkeys(("check_which",), "rundir.reader"),
    **dict.fromkeys(
        ("TIMM_SUFFIXES", "in_timm_output", "is_timm_checkpoint_name", "read_run_config"), "rundir.run_files"
    ),
    **dict.fromkeys(("read_timm_checkpoint", "timm_class_names", "timm_data_config"), "rundir.timm_files"),
    **dict.fromkeys(("image_mode",), "data.device_augment"),
    **dict.fromkeys(("build_transforms", "input_format"), "data.factory"),
    **dict.fromkeys(("kept",), "loop.start"),
}
__all__ = [
    "ConfigError",
    "DamagedCheckpointError",
    "DamagedFileError",
    "DamagedRunRecordError",
    "Extensions",
    "Interrupted",
    "NonFiniteLossError",
    "StorageError",
    "check_packages",
    "parse_config",
    "run",
    "validate",
    *_SUBMODULE_OF,
]


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_SUBMODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


def parse_config(argv: list[str] | None, *, models_registered: bool = False) -> Config:
    """argv (with its ``-c`` recipe) as a checked and frozen Config (``validate``'s checks). Raises one ConfigError
    naming every refused option and key with its reason (StorageError when --output cannot be written).
    ``models_registered``: the families are imported, so an unknown --model is named with the rest."""
    checks = partial(package_problems, models_registered=models_registered)
    return config_parsing.parse_config(argv, _evaluated_run_options, checks).freeze()


def _evaluated_run_options(target: str) -> dict[str, Any]:
    """What --eval-only RUN_DIR takes from the run directory it names (the rundir package reads it)."""
    from .rundir.checks import evaluated_run_options  # after --help: see the docstring

    return evaluated_run_options(target)


def validate(cfg: Config) -> None:
    """A Config built in Python through the checks of a command line, in place: the config package's checks
    (which normalize the options and derive their defaults), then every package's; the Config is frozen then (a
    frozen Config has passed them)."""
    if cfg.frozen:
        return
    config_parsing.validate(cfg)
    check_packages(cfg)
    cfg.freeze()


def check_packages(cfg: Config) -> None:
    """Each package's check of the options it owns, after the config package's own: the data source and
    format, timm's optimizer and the schedule's epochs, the compile backend, the resume file and output dir.
    Raises one ConfigError naming every package's refusal."""
    problems = package_problems(cfg)
    if problems:
        raise ConfigError("; ".join(problems))


def package_problems(cfg: Config, models_registered: bool = False) -> list[str]:
    """Every package's refusal of a checked Config (each package's first), as 'what: why' lines."""
    from .data import checks as data_checks  # the packages load torch: see the docstring
    from .model import checks as model_checks
    from .optim import checks as optim_checks
    from .rundir import checks as rundir_checks

    problems = []
    checks = [data_checks.check, optim_checks.check, model_checks.check, rundir_checks.check]
    if models_registered:
        checks.append(model_checks.check_names)
    for check in checks:
        try:
            check(cfg)
        except ConfigError as e:
            problems.append(str(e))
    return problems


def run(config: Config | list[str] | None = None, extensions: Extensions | None = None) -> dict[str, Any]:
    """Train (or evaluate with --eval-only) one run; returns the content of results.json (the metrics with
    --eval-only). ``config`` is a command line (parsed with its -c recipe) or a ``Config`` built in Python;
    either is validated first (a Config is copied, not changed)."""
    check_launch_environment()
    if isinstance(config, Config):
        cfg = config.replace()
        validate(cfg)
    else:
        cfg = parse_config(config, models_registered=extensions is not None)
    from .optim.factory import trained_epochs
    from .rundir.lock import RunLock  # imported after parsing: `train.py --help` loads no torch

    for warning in config_warnings(cfg, trained_epochs(cfg)):
        print_error(warning, prefix="warning")
    from .loop.setup import build_evaluator
    from .loop.start import start_run
    from .loop.trainer import build_trainer
    from .rundir.reader import RunDir

    lock = None if cfg.eval_only else RunLock(cfg.output)  # held for the life of the run (engine.rundir.lock)
    try:
        try:
            start = start_run(cfg, extensions, lock)
            if start.finished:  # --resume of a finished run: nothing to build, nothing more to write
                start.accelerator.print(start.finished)
                return RunDir(start.output).results()
            runner = build_evaluator(start) if cfg.eval_only else build_trainer(start)
        except FileNotFoundError:  # the checks name missing inputs themselves (ConfigError): this is a bug
            raise
        except OSError as e:  # the lock or the output dir cannot be written: disk full, read-only
            where = e.filename or cfg.output
            reason = storage_reason(e, cfg.output)
            raise StorageError(f"starting the run failed: {where}: {reason}; nothing was written") from None
        except KeyboardInterrupt:
            raise Interrupted("during set-up; nothing was written") from None
        for warning in runner.warnings:
            print_error(warning, prefix="warning")
        if cfg.eval_only:
            return runner.run()
        try:
            return runner.fit()
        except KeyboardInterrupt:
            raise Interrupted(runner.kept()) from None
        except (OSError, StorageError) as e:  # writing into the output failed: what failed, what is kept
            failure = e if isinstance(e, StorageError) else write_failure(e, e.filename or cfg.output)
            raise StorageError(f"{failure}; {runner.kept()}") from None
    finally:
        if lock is not None:
            lock.release()


def check_launch_environment() -> None:
    """ConfigError when the environment holds some of the variables a launcher sets for each process it starts
    (WORLD_SIZE above 1, or LOCAL_RANK) but not all: a process started by hand (``WORLD_SIZE=2 python train.py``)
    would wait in torch's rendezvous or fail in it with a traceback."""
    world_size = os.environ.get("WORLD_SIZE", "1")
    if not world_size.isdigit() or int(world_size) < 1:
        raise ConfigError(f"WORLD_SIZE={world_size!r} in the environment: expected the number of processes, >= 1")
    if int(world_size) == 1 and "LOCAL_RANK" not in os.environ:
        return
    missing = [name for name in _RENDEZVOUS_VARIABLES if not os.environ.get(name)]
    if missing:
        present = " ".join(f"{name}={os.environ[name]}" for name in ("WORLD_SIZE", "LOCAL_RANK") if name in os.environ)
        processes = max(int(world_size), 2)
        raise ConfigError(
            f"the environment holds {present} but not {', '.join(missing)}: the variables a launcher sets for each "
            f"process, here without a launcher; start the processes with `convbias-launch --num_processes "
            f"{processes} train.py ...` (--cpu on CPUs) or `accelerate launch --multi_gpu --num_processes "
            f"{processes} train.py ...`, or unset them to train in one process"
        )
