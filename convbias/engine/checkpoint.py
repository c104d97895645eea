"""Checkpoints: atomic writes, safetensors weights, resumable training state, checksums, safe loading.

Layout of ``<output>/checkpoints``::

    epoch_0007/             one complete resume point (written as .epoch_0007.tmp, then renamed)
    epoch_0007_step_0000120/  a mid-epoch resume point: 120 steps into the 8th epoch (preemption,
                            --checkpoint-interval); its training_state.pt also holds the step and the
                            loss accumulators
        model.safetensors   model weights (metadata: model name, epoch)
        ema.safetensors     EMA weights, with --model-ema
        training_state.pt   optimizer, scheduler, grad scaler, counters, RNG states of every rank
        sharded/            under FSDP: every rank's shards (torch distributed checkpoint)
        manifest.json       the size and sha256 of every file above, written last
    last -> epoch_0007      symlinks, swapped atomically (os.replace)
    best -> epoch_0005
    epoch_5.safetensors     --save-epochs snapshots (weights only)

A resume point is complete when its manifest is there and every file matches it: a kill at any moment
leaves the newest complete point intact (a point is renamed into place only once its manifest is
written, and a link swap is a single rename), and a damaged file is found before it is loaded. The
newest ``keep`` points (and ``best``) are kept; an older one is deleted only when its manifest lists
every file in it, i.e. the engine wrote all of it. Nothing else in the folder is ever deleted.

Loading never unpickles arbitrary objects: weights come from safetensors, and ``.pt`` files are read
with ``torch.load(weights_only=True)`` (tensors and plain containers only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from convbias.weights import (  # noqa: F401  (the engine's loading API is the shared one)
    WEIGHTS_FILE,
    check_compatible,
    load_weights,
    read_state_dict,
    resolve_weights_path,
    weights_metadata,
)

from .errors import DamagedCheckpointError, StorageError, storage_reason
from .run_dir import DEFAULT_KEEP_CHECKPOINTS

EMA_FILE = "ema.safetensors"
STATE_FILE = "training_state.pt"
MANIFEST_FILE = "manifest.json"
POINT_NAME = re.compile(r"epoch_(\d{4,})(?:_step_(\d{7,}))?")
_HASH_CHUNK = 1 << 22  # sha256 is streamed in 4 MiB reads
_WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)  # torch.save and safetensors report I/O their own way


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)``, then rename tmp_path over ``path``: readers see the old or the new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # on a read-only or removed output there is nothing to clean
            tmp.unlink(missing_ok=True)


def save_weights(state_dict: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write a state dict as safetensors, atomically. Tensors are copied to CPU (shared storage is fine)."""
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


# ----------------------------------------------------------------------------------------- RNG states
def rng_state() -> dict[str, Any]:
    """This process's RNG states in weights_only-loadable types (tensors, ints, tuples)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------ manifests
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(point: Path) -> list[str]:
    """Every file under ``point`` but its manifest, as relative POSIX paths."""
    return sorted(p.relative_to(point).as_posix() for p in point.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def write_manifest(point: Path, epoch: int, step: int) -> None:
    """The size and sha256 of every file of the resume point, written last (atomically)."""
    files = {
        name: {"bytes": (point / name).stat().st_size, "sha256": file_sha256(point / name)} for name in _files(point)
    }
    text = json.dumps({"epoch": epoch, "step": step, "files": files}, indent=1) + "\n"
    atomic_write(point / MANIFEST_FILE, lambda tmp: tmp.write_text(text))


def read_manifest(point: Path) -> dict[str, Any] | None:
    """The manifest's ``files`` entry; None when the point has none or it cannot be read."""
    try:
        files = json.loads((point / MANIFEST_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) else None


def check_point(point: Path, names: Iterable[str] | None = None) -> str | None:
    """None when the files ``names`` (default: all) of ``point`` match its manifest, else why not."""
    if not (point / MANIFEST_FILE).is_file():
        return f"no {MANIFEST_FILE}: the save did not complete"
    listed = read_manifest(point)
    if listed is None:
        return f"its {MANIFEST_FILE} is unreadable"
    for name in listed if names is None else names:
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
    if path.is_file() and (path.parent / MANIFEST_FILE).is_file():
        problem = check_point(path.parent, [path.name])
        if problem:
            raise DamagedCheckpointError(f"{path} is damaged: {problem}; it was not loaded")


# ------------------------------------------------------------------------------ resume points on disk
class CheckpointDir:
    """The ``checkpoints/`` folder of a run: write resume points, keep last and best, find them again."""

    def __init__(self, output: str | Path, keep: int = DEFAULT_KEEP_CHECKPOINTS):
        self.root = Path(output) / "checkpoints"
        self.keep = keep

    @property
    def last(self) -> Path | None:
        link = self.root / "last"
        return link.resolve() if (link / STATE_FILE).is_file() else None

    @property
    def best(self) -> Path | None:
        link = self.root / "best"
        return link.resolve() if (link / WEIGHTS_FILE).is_file() else None

    @staticmethod
    def point_name(epoch: int, step: int = 0) -> str:
        return f"epoch_{epoch:04d}" + (f"_step_{step:07d}" if step else "")

    def points(self) -> list[Path]:
        """The resume-point folders (named as ``point_name`` writes them), newest first."""
        found = []
        for path in self.root.glob("epoch_*") if self.root.is_dir() else ():
            match = POINT_NAME.fullmatch(path.name)
            if match and path.is_dir() and not path.is_symlink():
                found.append(((int(match[1]), int(match[2] or 0)), path))
        return [path for _, path in sorted(found, reverse=True)]

    def held(self) -> list[str]:
        """What in ``checkpoints/`` may hold weights: every entry but the links and a killed save's staging."""
        if not self.root.is_dir():
            return []
        return sorted(
            p.name
            for p in self.root.iterdir()
            if not p.is_symlink() and not (p.name.startswith(".") and p.name.endswith(".tmp"))
        )

    def select(self) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest intact resume point, and the newer ones skipped with the reason of each."""
        skipped = []
        for point in self.points():
            problem = check_point(point)
            if problem is None:
                return point.resolve(), skipped
            skipped.append((point, problem))
        return None, skipped

    def set_aside(self, point: Path) -> Path:
        """Rename a damaged point out of the way (``<name>.damaged``, numbered when taken); nothing is deleted."""
        target, n = point.with_name(point.name + ".damaged"), 1
        while target.exists() or target.is_symlink():
            n += 1
            target = point.with_name(f"{point.name}.damaged{n}")
        os.rename(point, target)
        return target

    def remove_staging(self) -> None:
        """A killed save's staging folders and link files: only the engine writes names of this form."""
        for path in self.root.glob(".*.tmp") if self.root.is_dir() else ():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _owned(self, point: Path) -> bool:
        """The engine wrote every file of ``point``: its manifest lists them all (a user's file stops this)."""
        listed = read_manifest(point)
        return listed is not None and set(_files(point)) <= set(listed)

    def _staging(self, name: str) -> Path:
        return self.root / f".{name}.tmp"

    def stage(self, epoch: int, step: int = 0) -> Path:
        """A fresh, empty directory for the resume point (epoch, step), under a temporary name (main process).
        Under FSDP every rank writes its shards there before ``save`` completes it and renames it into place."""
        tmp = self._staging(self.point_name(epoch, step))
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def save(
        self,
        epoch: int,
        weights: dict[str, torch.Tensor],
        state: dict[str, Any],
        ema_weights: dict[str, torch.Tensor] | None,
        metadata: dict[str, str],
        is_best: bool,
        step: int = 0,
    ) -> Path:
        """Complete the resume point that ``stage(epoch, step)`` started (after ``epoch`` completed epochs and
        ``step`` steps of the next one), rename it into place and point ``last`` (and ``best``) at it."""
        name = self.point_name(epoch, step)
        final, tmp = self.root / name, self._staging(name)
        if not tmp.is_dir():
            raise FileNotFoundError(f"{tmp}: stage({epoch}, {step}) first")
        try:
            save_file(
                {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()},
                str(tmp / WEIGHTS_FILE),
                metadata=metadata,
            )
            if ema_weights is not None:
                save_file(
                    {k: v.detach().to("cpu", copy=True).contiguous() for k, v in ema_weights.items()},
                    str(tmp / EMA_FILE),
                    metadata=metadata,
                )
            torch.save(state, tmp / STATE_FILE)
            write_manifest(tmp, epoch, step)
            if final.exists():  # an earlier attempt's point of the same name, which this one supersedes
                if self._owned(final):
                    shutil.rmtree(final)
                else:
                    self.set_aside(final)
            os.rename(tmp, final)
        except BaseException as e:  # a kill leaves the staging folder, removed at the next start
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, _WRITE_ERRORS):
                raise StorageError(f"writing the resume point {name} failed ({storage_reason(e, self.root)})") from None
            raise
        try:
            self._point("last", name)
            if is_best:
                self._point("best", name)
            self._remove_superseded()
        except OSError as e:  # the point itself is complete: --resume auto finds it by its name
            raise StorageError(f"updating checkpoints/last after writing {name} failed ({storage_reason(e)})") from None
        return final

    def _point(self, link_name: str, target: str) -> None:
        tmp = self.root / f".{link_name}.tmp"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(target, tmp)
        os.replace(tmp, self.root / link_name)

    def _remove_superseded(self) -> None:
        """Delete the engine's own points beyond the newest ``keep`` (``last`` and ``best`` stay)."""
        linked = {p.name for p in (self.last, self.best) if p is not None}
        owned = [p for p in self.points() if self._owned(p)]
        for path in owned[self.keep :]:
            if path.name not in linked:
                shutil.rmtree(path, ignore_errors=True)

    def save_snapshot(self, epoch: int, weights: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
        """``--save-epochs``: a weights-only copy that the last/best rotation never deletes."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"epoch_{epoch}.safetensors"
        try:
            save_weights(weights, path, metadata)
        except _WRITE_ERRORS as e:
            raise StorageError(f"writing the snapshot {path.name} failed ({storage_reason(e, self.root)})") from None
        return path


def find_resume_point(resume: str, output: str | Path) -> Path | None:
    """The checkpoint directory ``--resume`` names, checked against its manifest; for 'auto' the newest
    intact point of the run dir (None when it has none).

    Raises ValueError for an explicit path that holds no resume point, DamagedCheckpointError for one
    whose files do not match its manifest (a point without one, written before checksums, is taken as is).
    """
    if resume == "auto":
        return CheckpointDir(output).select()[0]
    path = Path(resume)
    for candidate in (path, path / "last", path / "checkpoints" / "last"):
        if (candidate / STATE_FILE).is_file() and (candidate / WEIGHTS_FILE).is_file():
            problem = check_point(candidate) if (candidate / MANIFEST_FILE).is_file() else None
            if problem:
                raise DamagedCheckpointError(f"--resume {resume}: {candidate} is damaged: {problem}")
            return candidate.resolve()
    raise ValueError(
        f"--resume {resume}: no checkpoint there (expected a run dir with checkpoints/last/, "
        f"or a checkpoint dir holding {WEIGHTS_FILE} and {STATE_FILE})"
    )


def load_training_state(point: Path) -> dict[str, Any]:
    """The training state of a resume point, loaded with weights_only=True."""
    try:
        return torch.load(point / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception:  # torch's message invites unpickling the file with weights_only=False: not ours to give
        raise DamagedCheckpointError(
            f"{point / STATE_FILE} is not a training state this engine wrote (damaged or foreign); it was not loaded"
        ) from None
