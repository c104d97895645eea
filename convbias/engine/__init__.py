"""The training engine: config, data, recipe, loop, checkpoints, logging. It names no model family.

``run(argv, extensions)`` trains (or evaluates) one run; ``main(argv, extensions)`` wraps it for the
command line (user mistakes print one ``error: ...`` line and exit 2; a diverged run exits 1; Ctrl-C
prints one ``interrupted: ...`` line saying what was kept and exits 130). The
models come from timm's registry and the family-specific pieces from ``extensions``
(``convbias.families`` builds both; ``train.py`` composes them).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from ..storage import storage_reason
from .config import config_warnings, parse_config
from .errors import (
    EXIT_DAMAGED,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_STORAGE,
    EXIT_USAGE,
    ConfigError,
    DamagedCheckpointError,
    Interrupted,
    NonFiniteLossError,
    StorageError,
)
from .extensions import Extensions
from .preemption import REQUEUE_EXIT_CODE, Preempted

# The engine's public API: what the console scripts, experiments and evaluation import. Beyond run and
# main, names are loaded from their submodule on first use (PEP 562 `__getattr__`), to keep start-up time
# low: the model, data and checkpoint modules import timm and accelerate, which `--help` does not need.
_SUBMODULE_OF = {
    **dict.fromkeys(("Config", "parse_config"), "config"),
    **dict.fromkeys(("OptionParser", "build_parser", "key_value", "yaml_scalar"), "options"),
    **dict.fromkeys(("build_datasets", "build_eval_loader", "dataset_info"), "data"),
    **dict.fromkeys(("DATASETS", "ImageFolderDataset"), "datasets"),
    **dict.fromkeys(("check_model_name", "create_model"), "modeling"),
    **dict.fromkeys(("OutputScale",), "output_scale"),
    **dict.fromkeys(
        (
            "DEFAULT_WHICH",
            "WHICH",
            "RunCheckpoint",
            "RunDir",
            "check_which",
            "is_run_dir",
            "read_run_config",
            "run_options",
        ),
        "run_dir",
    ),
    **dict.fromkeys(("CheckpointDir", "rng_state", "verify_file"), "checkpoint"),
    **dict.fromkeys(("read_log", "read_summary"), "run_log"),
    **dict.fromkeys(("COMPILE_MODES", "compile_model"), "compile"),
}
__all__ = [
    "ConfigError",
    "DamagedCheckpointError",
    "Extensions",
    "NonFiniteLossError",
    "StorageError",
    "main",
    "run",
    *_SUBMODULE_OF,
]


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_SUBMODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


def run(argv: list[str] | None = None, extensions: Extensions | None = None) -> dict[str, Any]:
    """Parse, validate, then train (or evaluate with --eval-only). Returns the content of results.json."""
    cfg = parse_config(argv)
    for warning in config_warnings(cfg):
        _print_error(warning, prefix="warning")
    from .lock import RunLock
    from .run_dir import RunDir
    from .trainer import Trainer  # imported after parsing: `train.py --help` loads no torch

    lock = None if cfg.eval_only else RunLock(cfg.output)  # held for the life of the run (engine.lock)
    try:
        try:
            trainer = Trainer(cfg, extensions, lock)
        except (ValueError, FileNotFoundError) as e:  # data, model and checkpoint checks; ConfigError included
            raise ConfigError(str(e)) from None
        except OSError as e:  # the lock or the output dir cannot be written: disk full, read-only
            where = e.filename or cfg.output
            reason = storage_reason(e, cfg.output)
            raise StorageError(f"starting the run failed: {where}: {reason}; nothing was written") from None
        except KeyboardInterrupt:
            raise Interrupted("during set-up; nothing was written") from None
        for warning in trainer.warnings:
            _print_error(warning, prefix="warning")
        if trainer.finished:
            trainer.accelerator.print(trainer.finished)
            return RunDir(trainer.output).results()
        try:
            return trainer.evaluate_only() if cfg.eval_only else trainer.fit()
        except KeyboardInterrupt:
            raise Interrupted(trainer.kept()) from None
        except (OSError, StorageError) as e:  # writing into the output failed: what failed, what is kept
            what = (
                str(e)
                if isinstance(e, StorageError)
                else f"writing {e.filename or cfg.output} failed ({storage_reason(e, cfg.output)})"
            )
            raise StorageError(f"{what}; {trainer.kept()}") from None
    finally:
        if lock is not None:
            lock.release()


def _close_progress_bars() -> None:
    """A run stopped mid-epoch leaves its progress bar open: clear it, so the message gets a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", [])):
        bar.close()


def _print_error(message: str, prefix: str = "error") -> None:
    _close_progress_bars()
    if os.environ.get("RANK", "0") == "0":  # one line for the user, not one per process
        print(f"{prefix}: " + " ".join(message.split()), file=sys.stderr)


def main(argv: list[str] | None = None, extensions: Extensions | None = None) -> int:
    """Command-line entry point: exit code 0 on success, else the code of engine.errors for each way a run
    stops (2 bad input, 1 diverged, 65 damaged checkpoint, 74 output not writable, 75 preempted, 130 Ctrl-C)."""
    try:
        run(argv, extensions)
    except Preempted as e:
        _print_error(str(e), prefix="preempted")
        return REQUEUE_EXIT_CODE
    except ConfigError as e:
        _print_error(str(e))
        return EXIT_USAGE
    except DamagedCheckpointError as e:
        _print_error(str(e))
        return EXIT_DAMAGED
    except StorageError as e:
        _print_error(str(e))
        return EXIT_STORAGE
    except NonFiniteLossError as e:
        _print_error(str(e))
        return EXIT_DIVERGED
    except Interrupted as e:
        _print_error(str(e), prefix="interrupted")
        return EXIT_INTERRUPTED
    return 0
