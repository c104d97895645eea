"""The run directory's layout: every file and folder name train.py writes, and how resume points are named.

Every other module, in the engine and outside it, takes these names from here (tests/test_run_layout.py
fails on a literal of one elsewhere). A run directory::

    config.yaml             the resolved options (its first line marks the folder as this engine's run)
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

Pure names and listings: no torch, nothing else of the engine.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub.constants import SAFETENSORS_SINGLE_FILE

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.csv"
LOG_FILE = "log.jsonl"
RESULTS_FILE = "results.json"
LOCK_FILE = ".lock"
TRACKER_DIR = "wandb"  # what accelerate's wandb tracker writes, with --log-wandb
CHECKPOINTS_DIR = "checkpoints"
# What train.py writes at the top of its output folder.
RUN_FILES = (CONFIG_FILE, SUMMARY_FILE, LOG_FILE, RESULTS_FILE, LOCK_FILE, CHECKPOINTS_DIR, TRACKER_DIR)

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
