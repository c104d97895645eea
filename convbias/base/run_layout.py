"""The run directory's layout: every file and folder name train.py writes, how resume points are named, and
which run or exported folder a path belongs to (the guard every writer goes through, `storage.atomic_write`).

Every other module, in the engine and outside it, takes these names from here (tests/base/test_run_layout.py
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
            training_state.pt       the state of the run's parts (engine.checkpoint.parts)
            sharded/                under FSDP: every rank's shards (torch distributed checkpoint)
            manifest.json           the size and sha256 of every file above, written last
        last -> epoch_0007          links, regenerated from the training state
        best -> epoch_0005
        epoch_5.safetensors         a --save-epochs snapshot (init: epoch_0.safetensors)
        snapshots.json              the size and sha256 of every snapshot

The output folders of the studies and sweeps are declared here too (``OwnedFolder``): the command that marks
each (its ``.owner`` file), the files its commands write there and those another command reads back, which the
same guard keeps from every other writer.

Names, listings and the first lines of a run's records: no torch; below the engine, which reads it.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.constants import PYTORCH_WEIGHTS_NAME, SAFETENSORS_SINGLE_FILE

from .errors import ConfigError, DamagedInputError
from .inputs import check_plain_file, json_record, read_head

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


def head_line(path: Path) -> bytes | None:
    """The first line of the regular file ``path`` (not a link), or None: read without blocking, bounded."""
    if path.is_symlink():
        return None
    head = read_head(path, MAX_FIRST_LINE)
    return None if head is None else head.split(b"\n", 1)[0] + (b"\n" if b"\n" in head else b"")


def written_by_engine(path: Path) -> bool:
    """``path`` (an entry of an output folder) is recognizably one that train.py wrote."""
    first = head_line(path)
    if first is None:
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
    """The run directory, exported folder or owned output folder whose own file ``path`` is (or would be):
    ``run_owning``, an entry of an exported folder (its config, weights, card, the run files copied beside
    them), or a file of a study's or sweep's folder that another command reads back (``owned_folder_of``)."""
    run = run_owning(path)
    if run is not None:
        return run
    exported = next((c.parent for c in _spellings(path) if is_export_dir(c.parent)), None)
    return exported if exported is not None else owned_folder_of(path)


def check_destination(path: str | Path, option: str = "--output", owner: str | Path | None = None) -> None:
    """ConfigError naming ``path`` when a command would write it over a file that another command reads
    (``folder_owning``: a run's, an exported folder's, a study's or sweep's), however the path is spelled;
    ``owner`` is the folder the writer owns (train.py's run, a study's output folder), whose files are its own
    to write."""
    folder = folder_owning(path)
    if folder is None or (owner is not None and _same(folder, owner)):
        return
    if run_owning(path) is not None:
        what = "run"
    elif is_export_dir(folder):
        what = "exported model"
    else:
        what = f"output folder of {marked_owner(folder).owner}"
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


# ------------------------------------------------------------------------ the studies' and sweeps' folders
# The mark of an owned output folder: its first line is the console script that owns the folder.
OWNER_FILE = ".owner"
OWNER_NOTE = "# this folder's files are read back by its commands; other commands do not write them\n"


@dataclass(frozen=True)
class OwnedFolder:
    """An output folder whose files another command reads back: marked by ``owner`` (``OWNER_FILE``), holding
    ``files`` (names or glob patterns relative to the folder, as ``fnmatch`` reads them: what its commands write
    there, the mark included), of which ``read_back`` are read back by a command: the write guard refuses them to
    any command but the folder's, and a command that writes into folders of others writes only where it is one
    of ``guests`` (docs/run-directory.md names who writes each)."""

    owner: str
    files: tuple[str, ...]
    read_back: tuple[str, ...]
    guests: tuple[str, ...] = ()  # the other commands whose documented workflow writes there

    def admits(self, writer: str) -> bool:
        """``writer`` (a console script) may write into this folder: its owner's or a guest's."""
        return writer == self.owner or writer in self.guests

    def declares(self, relative: str) -> bool:
        """``relative`` (a path inside the folder, '/'-separated) is one of the files its writers write."""
        return any(fnmatch.fnmatchcase(relative, pattern) for pattern in (OWNER_FILE, *self.files))

    def reads_back(self, relative: str) -> bool:
        """``relative`` is a file that a command reads back (or the mark)."""
        return any(fnmatch.fnmatchcase(relative, pattern) for pattern in (OWNER_FILE, *self.read_back))


# convbias-stability's tables (read back by --combine and convbias-stability-contrasts), and the trajectories
# convbias-stability-contrasts reads back
STABILITY_TABLE = "stability.csv"
STABILITY_LAYERS_TABLE = "stability_layers.csv"
TRAJECTORIES_TABLE = "trajectories.csv"
# convbias-sweep's record of its grid, its runs' table and logs, its ensembles; report.md of every sweep report
SWEEP_RECORD = "sweep.yaml"
SWEEP_RUNS_TABLE = "runs.csv"
SWEEP_ENSEMBLES_TABLE = "ensembles.csv"
SWEEP_LOGS_DIR = "logs"
SWEEP_LOG_SUFFIX = ".log"
SWEEP_RUNS_DIR = "runs"  # the sweep's train.py runs: each its own run directory
REPORT_FILE = "report.md"
REGIMES_COMMAND = "convbias-regimes"  # writes its tables and figure into the sweep's folder it summarizes
# convbias-phase-diagram's tables (its own config.yaml records its grid)
PHASE_NETS_TABLE = "nets.csv"
PHASE_CELLS_TABLE = "cells.csv"
# convbias-efcn-protocol's record of its options and its tables, read back by --stage summarize and single-seed
PROTOCOL_CONFIG = "protocol_config.yaml"
RELAX_TIMES_TABLE = "relax_times.csv"
BASELINES_TABLE = "baselines.csv"
# What every study writes beside its tables: other tables, markdown, figures (read by people, not commands)
STUDY_OUTPUTS = ("*.csv", "*.md", "*.png", "*.json")

STABILITY_FOLDER = OwnedFolder(
    owner="convbias-stability",
    files=(STABILITY_TABLE, STABILITY_LAYERS_TABLE, TRAJECTORIES_TABLE, *STUDY_OUTPUTS),
    read_back=(STABILITY_TABLE, STABILITY_LAYERS_TABLE, TRAJECTORIES_TABLE),
)
SWEEP_FOLDER = OwnedFolder(
    owner="convbias-sweep",
    files=(SWEEP_RECORD, f"{SWEEP_LOGS_DIR}/*{SWEEP_LOG_SUFFIX}", *STUDY_OUTPUTS),
    read_back=(SWEEP_RECORD, SWEEP_RUNS_TABLE, SWEEP_ENSEMBLES_TABLE, f"{SWEEP_LOGS_DIR}/*{SWEEP_LOG_SUFFIX}"),
    guests=(REGIMES_COMMAND,),
)
PHASE_DIAGRAM_FOLDER = OwnedFolder(
    owner="convbias-phase-diagram",
    files=(CONFIG_FILE, *STUDY_OUTPUTS),
    read_back=(CONFIG_FILE, PHASE_NETS_TABLE, PHASE_CELLS_TABLE, SWEEP_RUNS_TABLE, SWEEP_ENSEMBLES_TABLE),
    guests=(SWEEP_FOLDER.owner,),  # its report
)
EFCN_PROTOCOL_FOLDER = OwnedFolder(
    owner="convbias-efcn-protocol",
    files=(PROTOCOL_CONFIG, *STUDY_OUTPUTS),
    read_back=(PROTOCOL_CONFIG, RELAX_TIMES_TABLE, BASELINES_TABLE),
)
ROBUSTNESS_FOLDER = OwnedFolder(owner="convbias-robustness", files=STUDY_OUTPUTS, read_back=())
OWNED_FOLDERS = {
    folder.owner: folder
    for folder in (STABILITY_FOLDER, SWEEP_FOLDER, PHASE_DIAGRAM_FOLDER, EFCN_PROTOCOL_FOLDER, ROBUSTNESS_FOLDER)
}


def marked_owner(path: str | Path) -> OwnedFolder | None:
    """The declaration of the owned folder ``path`` is, by its mark (None: no folder, or not marked)."""
    first = head_line(Path(path) / OWNER_FILE)
    return OWNED_FOLDERS.get(first.decode("utf-8", errors="replace").strip()) if first else None


def owner_mark(folder: OwnedFolder) -> str:
    """The text of ``folder``'s mark: its owner, then a note for whoever opens it."""
    return f"{folder.owner}\n{OWNER_NOTE}"


def owned_folder_of(path: str | Path) -> Path | None:
    """The owned output folder whose read-back file ``path`` is (or would be), however spelled; else None."""
    for candidate in _spellings(path):
        for ancestor in list(candidate.parents)[:2]:  # top-level files and those of a subfolder (a sweep's logs)
            folder = marked_owner(ancestor)
            if folder is not None and folder.reads_back(candidate.relative_to(ancestor).as_posix()):
                return ancestor
    return None


def check_owned_files(path: str | Path, folder: OwnedFolder, option: str = "--output") -> None:
    """DamagedInputError (exit 65) naming the first of ``folder``'s files in the folder ``path`` that is not a
    regular file under one name (``inputs.check_plain_file``: a symbolic or hard link, a FIFO, a folder):
    checked before a writer writes anything, so that nothing is written through it and nothing half-written."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return
    subfolders = {pattern.split("/")[0] for pattern in folder.files if "/" in pattern}
    entries = sorted(path.iterdir())
    for name in sorted(subfolders):
        inner = path / name
        if inner.is_symlink() or (os.path.lexists(inner) and not inner.is_dir()):
            raise DamagedInputError(
                f"{option} {path}: {inner} is not the folder its command writes there (a link, or a file); "
                f"nothing was written: move it away"
            )
        entries += sorted(inner.iterdir()) if inner.is_dir() else []
    for entry in entries:
        if folder.declares(entry.relative_to(path).as_posix()):
            check_plain_file(entry, f"{option} {path}: its file", DamagedInputError)
