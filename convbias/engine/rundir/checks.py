"""The rundir package's part in reading a run's options, before any work starts: what --eval-only
RUN_DIR takes from the run directory it names, the file --resume names, and the output directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from convbias.base.errors import ConfigError, DamagedInputError, StorageError
from convbias.base.inputs import read_yaml
from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    TIMM_ARGS_FILE,
    check_destination,
    held_entries,
    is_train_run,
    run_owning,
)
from convbias.engine.rundir.timm_files import read_timm_checkpoint

from ..config.options import Config
from ..config.parsing import require
from ..config.timm_args import translate_timm_keys
from .run_files import (
    RUN_KEYS,
    TIMM_OUTPUT_FILES,
    TIMM_SUFFIXES,
    is_run_dir,
    is_timm_checkpoint_name,
    is_timm_output_dir,
    read_run_config,
)

# What --eval-only RUN_DIR takes from the run: its model and data (RUN_KEYS), and its loader processes (the
# parser's default would start workers where the run had none, as on a small machine or data set).
EVALUATED_RUN_KEYS = (*RUN_KEYS, "workers")


def timm_run_options(target: str | Path) -> dict[str, Any]:
    """The RUN_KEYS options of timm's run that ``target`` names: its output folder (its args.yaml, else a checkpoint's
    saved args) or one of its checkpoints (the args saved in it), read as timm's args.yaml keys."""
    path = Path(target)
    if path.is_dir():
        args_file = path / TIMM_ARGS_FILE
        if args_file.is_file():
            args = read_yaml(args_file, "timm args") or {}
        else:
            saved = next(path / name for name in TIMM_OUTPUT_FILES.values() if (path / name).is_file())
            args = read_timm_checkpoint(saved).args
    else:
        try:
            args = read_timm_checkpoint(path).args
        except DamagedInputError:  # weights alone (a state dict saved as .pth): loaded, and judged, as weights
            return {}
    options, _ = translate_timm_keys(dict(args), str(path))  # only the model and data keys are taken
    return {key: options[key] for key in RUN_KEYS if key in options}


def evaluated_run_options(target: str) -> dict[str, Any]:
    """The EVALUATED_RUN_KEYS options of the run directory that --eval-only (or --eval-only --checkpoint) names,
    or the model and data options of timm's output folder or checkpoint; {} for weights."""
    if is_timm_output_dir(target) or is_timm_checkpoint_name(target):
        return timm_run_options(target)
    if not is_run_dir(target):
        return {}
    options = read_run_config(target)
    return {key: options[key] for key in EVALUATED_RUN_KEYS if key in options}


def check_output_writable(output: str | Path) -> None:
    """--output must be (or become) a writable directory: checked before any set-up, nothing created."""
    path = Path(output)
    check_destination(path)  # a folder in another run's checkpoints/, or an entry of an exported model
    require(not path.exists() or path.is_dir(), f"--output {path} is a file; pass a directory (new or of this run)")
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    require(ancestor.is_dir(), f"--output {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):  # read-only: an I/O fault, as one met mid-run (exit 74)
        raise StorageError(f"--output {path}: {ancestor} is not writable (read-only); choose another --output")


def check(cfg: Config) -> None:
    """ConfigError when --resume names a file that is not timm's training checkpoint; ConfigError or StorageError
    when a training run's --output cannot become its directory."""
    resume = Path(cfg.resume) if cfg.resume and cfg.resume != "auto" else None
    require(
        resume is None or resume.exists(),
        f"--resume {cfg.resume}: path does not exist (a run directory, one of its checkpoints/ folders, timm's "
        f"last.pth.tar, or auto)",
    )
    require(
        resume is None or not resume.is_file() or str(resume).endswith(TIMM_SUFFIXES),
        f"--resume {cfg.resume} is a file, and not one of timm's training checkpoints (*{', *'.join(TIMM_SUFFIXES)}): "
        f"give a run directory, one of its checkpoints/ folders, or timm's last.pth.tar",
    )
    if not cfg.eval_only:
        check_output_writable(cfg.output)
        if resume is not None:
            check_resume_target(resume, Path(cfg.output))


def check_resume_target(resume: Path, output: Path) -> None:
    """An explicit --resume POINT continues into the point's own run or into a fresh --output: never into
    another run that holds resume points or snapshots, whose points, config and logs it would replace."""
    held = held_entries(output / CHECKPOINTS_DIR)
    if not held:
        return
    run = resume if is_train_run(resume) else run_owning(resume)
    if run is not None and run.resolve() == output.resolve():
        return
    source = f"a point of the run {run}" if run is not None else "not a point of that run"
    own = f" (--output {run})" if run is not None else ""
    raise ConfigError(
        f"--resume {resume} is {source}, and --output {output} is another run (its {CHECKPOINTS_DIR}/ holds "
        f"{', '.join(held)}): continuing there would replace its points, config and logs; continue into the "
        f"point's own run{own} or into a new --output"
    )
