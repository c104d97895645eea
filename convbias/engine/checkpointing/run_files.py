"""What a folder holds, recognized without reading a checkpoint: whether it is a run of train.py, which of
its files train.py wrote, whose file a path is, and the run's options (its config.yaml). Light to import (no
torch): option checks and ``--help`` read this module; reading a run's checkpoints is
engine.checkpointing.run_dir's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...inputs import first_line, json_record, read_yaml
from .layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LOCK_FILE,
    LOG_FILE,
    RUN_FILES,
    SUMMARY_FILE,
    is_temporary,
    point_position,
)

# The file names of timm's training checkpoints (its CheckpointSaver's .pth.tar, timm's usual .pth weights): a
# file named so is read as one (convbias.timm_checkpoint) where a command takes a run directory
TIMM_SUFFIXES = (".pth.tar", ".pth")


def is_timm_checkpoint_name(path: str | Path) -> bool:
    """Whether ``path`` is a file named as timm's checkpoints are (its content is checked when it is read)."""
    return str(path).endswith(TIMM_SUFFIXES) and Path(path).is_file()


# The first line of every config.yaml train.py writes: what marks a folder as this engine's run.
CONFIG_MARKER = "# resolved config of this run; reload with -c"
MAX_FIRST_LINE = 1 << 20  # bytes of a file's first line read to recognize it (a log record is far shorter)
# What a run's config.yaml contributes to a command that reuses the run: the model and how its data is read.
# Not --input-size: the config holds it resolved into img_size and in_chans, so a command may change --img-size.
RUN_KEYS = (
    "model",
    "model_kwargs",
    "img_size",
    "in_chans",
    "mean",
    "std",
    "num_classes",
    "first_classes",
    "class_map",
    "input_key",
    "target_key",
    "bn_eps",
    "gp",
    "fast_norm",
    "dataset",
    "data_dir",
    "crop_pct",
    "interpolation",
    "reparametrize",
    "reparametrize_kwargs",
    "output_scale",
)


def written_by_engine(path: Path) -> bool:
    """``path`` (an entry of an output folder) is recognizably one that train.py wrote."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            first = f.readline(MAX_FIRST_LINE)
    except OSError:
        return False
    if path.name == CONFIG_FILE:
        return first.rstrip(b"\n") == CONFIG_MARKER.encode()
    if path.name == SUMMARY_FILE:
        return first.startswith(b"epoch,") or first == b""
    if path.name == LOG_FILE:
        return first == b"" or isinstance(json_record(first), dict)
    return False


def foreign_entry(output: Path) -> str | None:
    """The first entry of an output folder that train.py did not recognizably write, with why (None: each
    is the engine's own, so the folder may be started over). A folder's checkpoints/, results.json and
    wandb/ count as the engine's only beside the config.yaml it marks."""
    if not output.is_dir():
        return None
    marked = written_by_engine(output / CONFIG_FILE)
    for entry in sorted(output.iterdir()):
        name = entry.name
        if name == LOCK_FILE or is_temporary(name):
            continue
        if entry.is_symlink():
            return f"{name} (a symbolic link to {os.readlink(entry)})"
        if name in (CONFIG_FILE, SUMMARY_FILE, LOG_FILE):
            if not written_by_engine(entry):
                return f"{name} (not as train.py writes it)"
        elif name not in RUN_FILES or not marked:
            return f"{name} (not a file train.py writes)" if name not in RUN_FILES else f"{name} (beside no run config)"
    return None


def foreign_links(output: Path) -> list[str]:
    """The files train.py writes in an output folder (top level and points) that are symbolic links: it
    writes nothing through a link it did not make (its own are checkpoints/last and best)."""
    found = [output / name for name in RUN_FILES if (output / name).is_symlink()]
    root = output / CHECKPOINTS_DIR
    if root.is_dir() and not root.is_symlink():
        found += [p for p in root.iterdir() if p.is_symlink() and point_position(p)]
    return [f"{p} -> {os.readlink(p)}" for p in found]


def run_owning(path: str | Path) -> Path | None:
    """The run directory whose own file ``path`` is (or would be): its config, logs, results, lock, or
    anything under its checkpoints/ (through links too); None for any other path."""
    path = Path(path).absolute()
    for candidate in (path, path.resolve()):
        if candidate.name in RUN_FILES and is_run_dir(candidate.parent):
            return candidate.parent
        for ancestor in candidate.parents:
            if ancestor.name == CHECKPOINTS_DIR and is_run_dir(ancestor.parent):
                return ancestor.parent
    return None


def check_not_run_file(path: str | Path, option: str = "--output") -> None:
    """ConfigError naming ``path`` when a command would write it over a file of a run (``run_owning``), or
    when it names a run directory where a command writes its own config.yaml and results."""
    run = run_owning(path)
    if run is not None:
        raise ConfigError(
            f"{option} {path} is a file of the run {run}; no command writes over a run's own files: choose another path"
        )


# timm's train.py output folder: CheckpointSaver's files beside its args.yaml, by --which
TIMM_OUTPUT_FILES = {"last": "last.pth.tar", "best": "model_best.pth.tar"}


def is_timm_output_dir(path: str | Path) -> bool:
    """An output folder of timm's train.py (last.pth.tar or model_best.pth.tar in it), not one of train.py's."""
    path = Path(path)
    return path.is_dir() and not is_run_dir(path) and any((path / f).is_file() for f in TIMM_OUTPUT_FILES.values())


def timm_output_file(folder: str | Path, which: str | None) -> Path:
    """The checkpoint of timm's output folder that --which names (default last, the run's final weights);
    ConfigError naming the folder when it lacks that file."""
    which = which or "last"
    path = Path(folder) / TIMM_OUTPUT_FILES[which]
    if not path.is_file():
        raise ConfigError(f"--which {which}: timm's output folder {folder} has no {path.name}")
    return path


def in_timm_output(path: str | Path, which: str | None) -> tuple[str, str | None]:
    """(the path a command reads, the --which left for it): timm's output folder is its checkpoint by --which, read
    as that file (no --which left); any other path is itself."""
    if is_timm_output_dir(path):
        return str(timm_output_file(path, which)), None
    return str(path), which


def is_run_dir(path: str | Path) -> bool:
    """A directory written by train.py: it holds config.yaml (and, once an epoch is done, checkpoints/)."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_run_config(run: str | Path) -> dict[str, Any]:
    """The run's resolved options (its config.yaml); ConfigError naming the file when it cannot be read."""
    path = Path(run) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{run} is not a run directory: no {CONFIG_FILE} in it")
    try:
        data = read_yaml(path, "run config")
    except OSError as e:
        raise ConfigError(f"{path} is not a readable run config ({first_line(e)})") from None
    if not isinstance(data, dict) or "model" not in data:
        raise ConfigError(f"{path} is not a run config (expected a mapping of option: value with a model)")
    return data
