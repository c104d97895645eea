"""What a folder holds, recognized without reading a checkpoint: whether it is a run of train.py or timm's output
folder, which of its entries train.py did not write, and the run's options (its config.yaml); whose file a path
is, convbias.base.run_layout's. Light to import (no
torch): option checks and ``--help`` read this module; reading a run's checkpoints is
engine.rundir.reader's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from convbias.base.errors import ConfigError, DamagedInputError
from convbias.base.inputs import quoted, read_yaml
from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LOCK_FILE,
    LOG_FILE,
    RUN_FILES,
    SUMMARY_FILE,
    TIMM_ARGS_FILE,
    is_temporary,
    point_position,
    written_by_engine,
)

from ..config.options import did_you_mean, option_names, with_option_names
from ..config.parsing import check_option, coerce

# The file names of timm's training checkpoints (its CheckpointSaver's .pth.tar, timm's usual .pth weights): a
# file named so is read as one (convbias.engine.rundir.timm_files) where a command takes a run directory
TIMM_SUFFIXES = (".pth.tar", ".pth")


def is_timm_checkpoint_name(path: str | Path) -> bool:
    """Whether ``path`` is a file named as timm's checkpoints are (its content is checked when it is read)."""
    return str(path).endswith(TIMM_SUFFIXES) and Path(path).is_file()


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
        if name in (CONFIG_FILE, TIMM_ARGS_FILE, SUMMARY_FILE, LOG_FILE):
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
    return path.is_dir() and os.path.lexists(path / CONFIG_FILE)  # whatever it is: read_run_config checks it


def read_run_config(run: str | Path) -> dict[str, Any]:
    """The run's resolved options (its config.yaml), each value passed through the checks of its option (type
    and range) as a command line's is; DamagedInputError naming the file and the key when it is not a regular
    file, too large, not YAML, or a key or value is not an option's; ConfigError when there is no config.yaml."""
    path = Path(run) / CONFIG_FILE
    if not path.exists():
        raise ConfigError(f"{run} is not a run directory: no {CONFIG_FILE} in it")
    data = read_yaml(path, "run config", DamagedInputError)
    if not isinstance(data, dict) or not isinstance(data.get("model"), str):
        raise DamagedInputError(f"{path} is not a run config (expected a mapping of option: value with a model)")
    options = {}
    for key, value in with_option_names(data, str(path)).items():
        if key not in option_names():
            raise DamagedInputError(f"{path}: {quoted(key)}: not an option of train.py{did_you_mean(str(key))}")
        try:
            options[key] = coerce(key, value, label=f"{path}: {key}")
            check_option(key, options[key], label=f"{path}: {key}")
        except ConfigError as e:
            raise DamagedInputError(str(e)) from None
    return options
