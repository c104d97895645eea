"""The run directory's layout: every file and folder name train.py writes, how resume points are named, and
which run or exported folder a path belongs to (the guard every writer goes through, `storage.atomic_write`).

Every other module, in the engine and outside it, takes these names from here (tests/test_run_layout.py
fails on a literal of one elsewhere). A run directory::

    config.yaml             the resolved options (its first line marks the folder as this engine's run)
    args.yaml               the same run as timm's train.py's args.yaml (what timm cannot express: at its top)
    summary.csv, log.jsonl  one row / record per epoch
    results.json            the final and best evaluations, once the run is done
    .lock                   the lock of the run that writes the folder
    wandb/                  the tracker's folder, with --log-wandb
    checkpoints/
        epoch_0007/                 a resume point after 7 epochs (staged as .epoch_0007.tmp)
        epoch_0007_step_0000120/    a mid-epoch resume point: 120 steps into the 8th epoch
            model.safetensors       the weights
            ema.safetensors         the EMA's weights, with --model-ema
            training_state.pt       the state of the run's parts (engine.checkpointing.state_parts)
            sharded/                under FSDP: every rank's shards (torch distributed checkpoint)
            manifest.json           the size and sha256 of every file above, written last
        last -> epoch_0007          links, regenerated from the training state
        best -> epoch_0005
        epoch_5.safetensors         a --save-epochs snapshot (init: epoch_0.safetensors)
        snapshots.json              the size and sha256 of every snapshot

Names, listings and the first lines of a run's records: no torch; below the engine, which reads it.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub.constants import PYTORCH_WEIGHTS_NAME, SAFETENSORS_SINGLE_FILE

from .errors import ConfigError
from .inputs import json_record

CONFIG_FILE = "config.yaml"
TIMM_ARGS_FILE = "args.yaml"  # timm's train.py's name: beside its checkpoints, and in a run of train.py
SUMMARY_FILE = "summary.csv"
LOG_FILE = "log.jsonl"
RESULTS_FILE = "results.json"
LOCK_FILE = ".lock"
TRACKER_DIR = "wandb"  # what accelerate's wandb tracker writes, with --log-wandb
CHECKPOINTS_DIR = "checkpoints"
# What train.py writes at the top of its output folder.
RUN_FILES = (CONFIG_FILE, TIMM_ARGS_FILE, SUMMARY_FILE, LOG_FILE, RESULTS_FILE, LOCK_FILE, CHECKPOINTS_DIR, TRACKER_DIR)

# The files of one resume point. The weights file has the Hugging Face Hub's name, so a point folder also loads
# as an exported model folder does (timm's local-dir:).
WEIGHTS_FILE = SAFETENSORS_SINGLE_FILE
EMA_FILE = "ema.safetensors"
STATE_FILE = "training_state.pt"
MANIFEST_FILE = "manifest.json"
SHARDED_DIR = "sharded"
SHARDED_METADATA = ".metadata"  # the index torch distributed checkpoint writes beside the shards

LAST_LINK, BEST_LINK = "last", "best"
LINKS = (LAST_LINK, BEST_LINK)  # the links of checkpoints/ to a resume point, regenerated from the training state

SNAPSHOTS_FILE = "snapshots.json"  # size and sha256 of every --save-epochs snapshot
INIT_SNAPSHOT = "init"  # the --save-epochs 0 snapshot, by the name commands give it
POINT_NAME = re.compile(r"epoch_(\d{4,})(?:_step_(\d{7,}))?")
SNAPSHOT_NAME = re.compile(rf"{INIT_SNAPSHOT}|epoch_(\d+)")
SNAPSHOT_SUFFIX = ".safetensors"
STAGING_GLOB = ".*.tmp"  # what a killed save or atomic write leaves: hidden .NAME.tmp names, only the engine's


def point_name(epoch: int, step: int = 0) -> str:
    """The folder name of the resume point after ``epoch`` epochs and ``step`` steps of the next one."""
    return f"epoch_{epoch:04d}" + (f"_step_{step:07d}" if step else "")


def point_position(path: Path) -> tuple[int, int] | None:
    """(epoch, step) of a resume point folder by its name; None for any other name."""
    match = POINT_NAME.fullmatch(path.name)
    return (int(match[1]), int(match[2] or 0)) if match else None


def snapshot_name(epoch: int) -> str:
    """The name commands give the ``--save-epochs`` snapshot after ``epoch`` epochs (``--which``, ``--checkpoints``)."""
    return f"epoch_{epoch}"


def snapshot_file(epoch: int) -> str:
    """The file name of the ``--save-epochs`` snapshot after ``epoch`` epochs."""
    return snapshot_name(epoch) + SNAPSHOT_SUFFIX


def snapshot_epoch(name: str) -> int:
    """The epoch of a snapshot by the name commands give it (``init`` or ``epoch_N``, ``SNAPSHOT_NAME``)."""
    match = SNAPSHOT_NAME.fullmatch(name)
    return 0 if name == INIT_SNAPSHOT else int(match[1])


def staging_name(name: str) -> str:
    """The hidden name a resume point (or a link) is written under before it is renamed into place."""
    return f".{name}.tmp"


def is_temporary(name: str) -> bool:
    """A hidden ``.NAME.tmp...`` file or folder: what a killed atomic write or save leaves (only the engine
    writes such names)."""
    return name.startswith(".") and ".tmp" in name


def list_points(root: Path) -> list[Path]:
    """The resume-point folders of a ``checkpoints/`` folder by name, newest first (not yet verified)."""
    found = []
    for path in root.glob("epoch_*") if root.is_dir() else ():
        position = point_position(path)
        if position and path.is_dir() and not path.is_symlink():
            found.append((position, path))
    return [path for _, path in sorted(found, reverse=True)]


def held_entries(root: Path) -> list[str]:
    """What in a ``checkpoints/`` folder may hold weights: every entry but the links and a killed save's
    staging (hidden ``.NAME.tmp`` names, which only the engine writes)."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if not p.is_symlink() and not is_temporary(p.name))


# What marks a folder as an exported model: timm's save_for_hf config beside the weights timm's local-dir: loads
EXPORT_CONFIG = "config.json"
EXPORT_WEIGHTS = (SAFETENSORS_SINGLE_FILE, PYTORCH_WEIGHTS_NAME)

# The first line of every config.yaml train.py writes: what marks a folder as this engine's run.
CONFIG_MARKER = "# resolved config of this run; reload with -c"
# The first line of the args.yaml train.py writes beside it
TIMM_ARGS_MARKER = "# this run as timm's train.py args.yaml; timm's train.py and this one train it with -c"
MAX_FIRST_LINE = 1 << 20  # bytes of a file's first line read to recognize it (a log record is far shorter)


def written_by_engine(path: Path) -> bool:
    """``path`` (an entry of an output folder) is recognizably one that train.py wrote."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            first = f.readline(MAX_FIRST_LINE)
    except OSError:
        return False
    if path.name in (CONFIG_FILE, TIMM_ARGS_FILE):
        return first.rstrip(b"\n") == (CONFIG_MARKER if path.name == CONFIG_FILE else TIMM_ARGS_MARKER).encode()
    if path.name == SUMMARY_FILE:
        return first.startswith(b"epoch,") or first == b""
    if path.name == LOG_FILE:
        return first == b"" or isinstance(json_record(first), dict)
    return False


def run_owning(path: str | Path) -> Path | None:
    """The run directory whose own file ``path`` is (or would be): its config, logs, results, lock, or
    anything under its checkpoints/ (through links too); None for any other path. A run is recognized by the
    config.yaml train.py marks (``is_train_run``)."""
    for candidate in _spellings(path):
        if candidate.name in RUN_FILES and is_train_run(candidate.parent):
            return candidate.parent
        for ancestor in candidate.parents:
            if ancestor.name == CHECKPOINTS_DIR and is_train_run(ancestor.parent):
                return ancestor.parent
    return None


def is_train_run(path: str | Path) -> bool:
    """A folder whose config.yaml train.py wrote (its first line is ``CONFIG_MARKER``)."""
    return written_by_engine(Path(path) / CONFIG_FILE)


def is_export_dir(path: str | Path) -> bool:
    """A folder that loads as an exported model (convbias-export's, timm's ``local-dir:``): its config.json
    beside its weights."""
    path = Path(path)
    return (path / EXPORT_CONFIG).is_file() and any((path / name).is_file() for name in EXPORT_WEIGHTS)


def folder_owning(path: str | Path) -> Path | None:
    """The run directory or exported folder whose own file ``path`` is (or would be): ``run_owning``, or an
    entry of an exported folder (its config, weights, card, the run files copied beside them)."""
    run = run_owning(path)
    if run is not None:
        return run
    return next((c.parent for c in _spellings(path) if is_export_dir(c.parent)), None)


def check_destination(path: str | Path, option: str = "--output", owner: str | Path | None = None) -> None:
    """ConfigError naming ``path`` when a command would write it over a file that another command reads
    (``folder_owning``: a run's or an exported folder's), however the path is spelled; ``owner`` is the
    folder the writer owns (train.py's run), whose files are its own to write."""
    folder = folder_owning(path)
    if folder is None or (owner is not None and _same(folder, owner)):
        return
    what = "run" if run_owning(path) is not None else "exported model"
    raise ConfigError(
        f"{option} {path} is a file of the {what} {folder.resolve()}; no command writes over a file another command "
        f"reads: choose another path"
    )


def check_output_folder(path: str | Path, option: str = "--output") -> None:
    """ConfigError when a command's output folder is a run directory, an exported folder, or inside one's
    own files: the files the command writes there could be theirs."""
    for candidate in _spellings(path):
        if is_train_run(candidate) or is_export_dir(candidate):
            what = "a train.py run" if is_train_run(candidate) else "an exported model"
            raise ConfigError(
                f"{option} {path} is {what} ({candidate}); its files are read by other commands: choose another folder"
            )
    check_destination(path, option)


def _spellings(path: str | Path) -> tuple[Path, Path]:
    """``path`` as given (made absolute) and with its links and ``..`` resolved: a file of a folder is
    recognized by either."""
    path = Path(path).absolute()
    return path, path.resolve()


def _same(a: str | Path, b: str | Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()
