"""A resume point's manifest and the snapshot listing: written after every file of a point (``write_manifest``) and
checked before any of them is read (``check_point``, ``verify_file``, ``verify_snapshot``). The one module that
knows the format of both; the writer (engine.checkpoint.points) and every reader (``RunDir``) go through it."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from convbias.base.errors import DamagedCheckpointError
from convbias.base.inputs import check_plain_file, quoted, read_json
from convbias.base.run_layout import (
    EMA_FILE,
    MANIFEST_FILE,
    SHARDED_DIR,
    SNAPSHOT_NAME,
    SNAPSHOT_SUFFIX,
    SNAPSHOTS_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    snapshot_epoch,
    snapshot_file,
)
from convbias.base.storage import write_text
from convbias.base.weights import weights_metadata

_HASH_CHUNK = 1 << 22  # sha256 is streamed in 4 MiB reads


SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def is_count(value: Any) -> bool:
    """An integer >= 0 (a JSON true is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ------------------------------------------------------------------------------- verifying what was written
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def point_files(point: Path) -> list[str]:
    """Every file under ``point`` but its manifest, as relative POSIX paths."""
    return sorted(p.relative_to(point).as_posix() for p in point.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def load_manifest(point: Path) -> dict[str, Any]:
    """The manifest of ``point``, every field checked: ``files`` a non-empty mapping of the point's relative
    file names to their ``bytes`` (an integer >= 0) and ``sha256`` (64 hex digits); ``epoch``, ``step`` and
    ``best_epoch`` integers >= 0 where present (``best_epoch`` may be null). DamagedCheckpointError naming the
    file and the key otherwise (a FIFO or device in its place is never opened)."""
    path = point / MANIFEST_FILE
    manifest = read_json(path, "manifest", DamagedCheckpointError)

    def damaged(key: str, problem: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(f"{path}: {key}: {problem}")

    if not isinstance(manifest, dict):
        raise damaged("(top level)", f"expected an object, got {type(manifest).__name__}")
    for key in ("epoch", "step", "best_epoch"):
        value = manifest.get(key)
        if value is None and (key == "best_epoch" or key not in manifest):
            continue
        if not is_count(value):
            raise damaged(key, f"expected an integer >= 0, got {quoted(value)}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise damaged("files", f"expected the point's files with their size and sha256, got {quoted(files)}")
    for name, entry in files.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or name == MANIFEST_FILE:
            raise damaged(f"files: {quoted(name)}", "not the name of a file inside the point")
        problem = entry_problem(entry)
        if problem:
            raise damaged(f"files: {name}: {problem[0]}", problem[1])
    return manifest


def entry_problem(entry: Any) -> tuple[str, str] | None:
    """(the key, what is wrong) of a file's entry in a manifest or the snapshot listing: ``bytes`` an integer
    >= 0, ``sha256`` 64 hex digits; None when it is one."""
    entry = entry if isinstance(entry, dict) else {}
    size, digest = entry.get("bytes"), entry.get("sha256")
    if not is_count(size):
        return "bytes", f"expected an integer >= 0, got {quoted(size)}"
    if not (isinstance(digest, str) and SHA256_HEX.fullmatch(digest)):
        return "sha256", f"expected 64 hex digits, got {quoted(digest)}"
    return None


def read_snapshots(root: Path) -> dict[str, dict[str, Any]]:
    """The listing of a run's ``--save-epochs`` snapshots, ``checkpoints/snapshots.json`` ({} when there is none):
    an object of snapshot file names (``epoch_N.safetensors``) to their entries (``entry_problem``), read as the
    file the engine wrote (a plain regular file: never through a link, never a FIFO). DamagedCheckpointError
    (exit 65) naming the file and the field otherwise: what it lists cannot be verified."""
    path = root / SNAPSHOTS_FILE
    if not os.path.lexists(path):
        return {}
    listing = read_json(path, "snapshot listing", DamagedCheckpointError, plain=True)
    if not isinstance(listing, dict):
        raise DamagedCheckpointError(f"{path}: (top level): expected an object, got {type(listing).__name__}")
    for name, entry in listing.items():
        stem = name.removesuffix(SNAPSHOT_SUFFIX)
        if stem == name or not SNAPSHOT_NAME.fullmatch(stem) or snapshot_file(snapshot_epoch(stem)) != name:
            raise DamagedCheckpointError(
                f"{path}: {quoted(name)}: not the name of a snapshot (epoch_N{SNAPSHOT_SUFFIX})"
            )
        problem = entry_problem(entry)
        if problem:
            raise DamagedCheckpointError(f"{path}: {name}: {problem[0]}: {problem[1]}")
    return listing


def read_manifest(point: Path) -> dict[str, Any] | None:
    """The manifest's ``files`` entry; None when the point has none or it is damaged."""
    try:
        return load_manifest(point)["files"]
    except DamagedCheckpointError:
        return None


def loaded_files(point: Path) -> list[str]:
    """The files of ``point`` that a resume loads (weights, EMA, training state, shards): each must be in the
    manifest, so a manifest that lists fewer cannot vouch for the point."""
    return [
        name
        for name in point_files(point)
        if name in (WEIGHTS_FILE, EMA_FILE, STATE_FILE) or name.startswith(f"{SHARDED_DIR}/")
    ]


def check_point(point: Path, names: Iterable[str] | None = None) -> str | None:
    """None when the files ``names`` (default: every file the manifest lists and every file a resume loads)
    of ``point`` match its manifest, else why not."""
    if not os.path.lexists(point / MANIFEST_FILE):
        return f"no {MANIFEST_FILE}: the save did not complete"
    try:
        listed = load_manifest(point)["files"]
    except DamagedCheckpointError as e:
        return f"{e}"
    for name in dict.fromkeys([*listed, *loaded_files(point)]) if names is None else names:
        entry, path = listed.get(name), point / name
        if entry is None:
            return f"{name} is not in its {MANIFEST_FILE}"
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry.get("bytes"):
            return f"{name} has {path.stat().st_size} bytes, its manifest says {entry.get('bytes')}"
        if file_sha256(path) != entry.get("sha256"):
            return f"{name} does not match its sha256 (damaged)"
    return None


def verify_file(path: str | Path) -> None:
    """DamagedCheckpointError when ``path`` lies in a resume point whose manifest it does not match
    (a file without a manifest beside it is loaded as it is)."""
    path = Path(path)
    if path.is_file() and os.path.lexists(path.parent / MANIFEST_FILE):
        problem = check_point(path.parent, [path.name])
        if problem:
            raise DamagedCheckpointError(f"{path} is damaged: {problem}; it was not loaded")


def file_entry(path: Path) -> dict[str, Any]:
    """What a manifest records of a file: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def check_snapshots(root: Path) -> dict[str, dict[str, Any]]:
    """What a run writing ``--save-epochs`` snapshots into ``root`` (its checkpoints/) checks first: the listing
    (``read_snapshots``, returned) and every snapshot file there a plain regular file (never a link or FIFO:
    ``inputs.check_plain_file``); a DamagedCheckpointError (exit 65) naming the first that is not."""
    listing = read_snapshots(root)
    for path in sorted(root.glob(f"*{SNAPSHOT_SUFFIX}")) if root.is_dir() else ():
        if SNAPSHOT_NAME.fullmatch(path.name.removesuffix(SNAPSHOT_SUFFIX)):
            check_plain_file(path, "snapshot", DamagedCheckpointError)
    return listing


def verify_snapshot(path: Path) -> None:
    """DamagedCheckpointError unless a ``--save-epochs`` snapshot is a plain file matching its entry in
    ``snapshots.json`` (``read_snapshots``; one written before that file existed must at least read as
    safetensors)."""
    check_plain_file(path, "snapshot", DamagedCheckpointError)
    listed = read_snapshots(path.parent).get(path.name)
    if listed is None:
        try:
            weights_metadata(path)
        except ValueError as e:
            raise DamagedCheckpointError(f"{e}; it was not loaded") from None
        return
    if path.stat().st_size != listed.get("bytes") or file_sha256(path) != listed.get("sha256"):
        raise DamagedCheckpointError(
            f"{path} is damaged: it does not match its entry in {SNAPSHOTS_FILE}; it was not loaded"
        )


# ------------------------------------------------------------------------------------------ manifests
def write_manifest(point: Path, epoch: int, step: int, best_epoch: int | None = None) -> None:
    """The size and sha256 of every file of the resume point, written last (atomically), with the epoch of
    the run's best point so far (what ``RunDir`` reads to find it without loading the training state)."""
    files = {name: file_entry(point / name) for name in point_files(point)}
    text = json.dumps({"epoch": epoch, "step": step, "best_epoch": best_epoch, "files": files}, indent=1) + "\n"
    write_text(point / MANIFEST_FILE, text, owner=point.parent.parent)
