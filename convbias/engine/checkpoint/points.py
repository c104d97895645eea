"""Writing resume points: atomic writes, safetensors weights, manifests, the ``last``/``best`` links, rotation,
``--save-epochs`` snapshots, and RNG states in a loadable form. The names are base.run_layout's;
reading and verifying a point is engine.rundir.reader's.

A resume point is complete when its manifest is there and every file matches it: a kill at any moment
leaves the newest complete point intact (a point is written under a hidden staging name and renamed into
place only once its manifest is written, and a link swap is a single rename), and a damaged file is found
before it is loaded. The newest ``keep`` points (and ``best``, and the --checkpoint-hist best) are kept; an
older one is deleted only when its manifest lists every file in it, i.e. the engine wrote all of it. Nothing
else in the folder is ever deleted.

Loading never unpickles arbitrary objects: weights come from safetensors, and ``.pt`` files are read
with ``torch.load(weights_only=True)`` (tensors and plain containers only).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from convbias.base.errors import StorageError
from convbias.base.run_layout import (
    BEST_LINK,
    CHECKPOINTS_DIR,
    EMA_FILE,
    LAST_LINK,
    LINKS,
    SNAPSHOTS_FILE,
    STAGING_GLOB,
    STATE_FILE,
    WEIGHTS_FILE,
    held_entries,
    list_points,
    point_name,
    snapshot_file,
    staging_name,
)
from convbias.base.storage import atomic_write, file_system, storage_reason, write_text

from ..config.options import DEFAULT_KEEP_CHECKPOINTS
from ..rundir.manifest import check_point, check_snapshots, file_entry, point_files, read_manifest, write_manifest

# torch.save and safetensors report I/O their own way; a StorageError is base.storage's, read by its cause
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError, StorageError)


def save_weights(
    state_dict: dict[str, torch.Tensor],
    path: str | Path,
    metadata: dict[str, str] | None = None,
    owner: str | Path | None = None,
) -> None:
    """Write a state dict as safetensors, atomically. Tensors are copied to CPU (shared storage is fine).
    ``owner``: the run whose file ``path`` is, when the run writes it (``convbias.base.run_layout.check_destination``)."""
    tensors = cpu_copy(state_dict)
    atomic_write(path, lambda tmp: file_system().save_safetensors(tensors, tmp, metadata), owner)


def cpu_copy(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as safetensors writes them: detached, contiguous copies on the CPU (shared storage is fine)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}


def payload_bytes(obj: Any) -> int:
    """The bytes of every tensor in a (nested) state: about what writing it takes on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


# ------------------------------------------------------------------------------ resume points on disk
class CheckpointDir:
    """The ``checkpoints/`` folder of a run as the training loop writes it: resume points, their rotation,
    the ``last``/``best`` links and snapshots. Reading a run is ``engine.rundir.reader.RunDir``'s."""

    def __init__(self, output: str | Path, keep: int = DEFAULT_KEEP_CHECKPOINTS):
        self.root = Path(output) / CHECKPOINTS_DIR
        self.keep = keep

    @staticmethod
    def point_name(epoch: int, step: int = 0) -> str:
        return point_name(epoch, step)

    def points(self) -> list[Path]:
        """The resume-point folders (named as ``point_name`` writes them), newest first."""
        return list_points(self.root)

    def held(self) -> list[str]:
        """What in ``checkpoints/`` may hold weights: every entry but the links and a killed save's staging."""
        return held_entries(self.root)

    def select(self) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest intact resume point, and the newer ones skipped with the reason of each."""
        skipped = []
        for point in self.points():
            problem = check_point(point)
            if problem is None:
                return point.resolve(), skipped
            skipped.append((point, problem))
        return None, skipped

    def set_aside(self, path: Path, suffix: str = ".damaged") -> Path:
        """Rename ``path`` out of the way (``<name><suffix>``, numbered when taken); nothing is deleted."""
        target, n = path.with_name(path.name + suffix), 1
        while target.exists() or target.is_symlink():
            n += 1
            target = path.with_name(f"{path.name}{suffix}{n}")
        file_system().rename(path, target)
        return target

    def remove_staging(self) -> None:
        """A killed save's staging folders and link files: only the engine writes names of this form."""
        for path in self.root.glob(STAGING_GLOB) if self.root.is_dir() else ():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _owned(self, point: Path) -> bool:
        """The engine wrote every file of ``point``: its manifest lists them all (a user's file stops this)."""
        listed = read_manifest(point)
        return listed is not None and set(point_files(point)) <= set(listed)

    def _staging(self, name: str) -> Path:
        return self.root / staging_name(name)

    def stage(self, epoch: int, step: int = 0) -> Path:
        """A fresh, empty directory for the resume point (epoch, step), under a temporary name (main process).
        Under FSDP every rank writes its shards there before ``save`` completes it and renames it into place."""
        tmp = self._staging(self.point_name(epoch, step))
        if tmp.is_symlink():  # a link in the staging name's place: removed, never written through
            tmp.unlink()
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
        ``step`` steps of the next one), rename it into place and point ``last`` (and ``best``) at it. The
        best point that ``state["best"]`` records, and those of the evaluations ``state["ranked"]`` lists
        (--checkpoint-hist), are never rotated away."""
        name = self.point_name(epoch, step)
        final, tmp = self.root / name, self._staging(name)
        if not tmp.is_dir():
            raise FileNotFoundError(f"{tmp}: stage({epoch}, {step}) first")
        files = file_system()
        try:
            files.save_safetensors(cpu_copy(weights), tmp / WEIGHTS_FILE, metadata)
            if ema_weights is not None:
                files.save_safetensors(cpu_copy(ema_weights), tmp / EMA_FILE, metadata)
            files.save_torch(state, tmp / STATE_FILE)
            write_manifest(tmp, epoch, step, (state.get("best") or {}).get("epoch"))
            if final.is_symlink():  # a link put there: set aside, never deleted or written through
                self.set_aside(final, ".link")
            elif final.exists():  # an earlier attempt's point of the same name, which this one supersedes
                if self._owned(final):
                    shutil.rmtree(final)
                else:
                    self.set_aside(final)
            files.rename(tmp, final)
        except BaseException as e:  # a kill leaves the staging folder, removed at the next start
            if isinstance(e, WRITE_ERRORS):  # why, before the staging folder's space is given back
                needed = payload_bytes((weights, ema_weights, state))
                reason = storage_reason(e, self.root, needed)
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, WRITE_ERRORS):
                raise StorageError(f"writing the resume point {name} failed ({reason})") from None
            raise
        ranked = [(state.get("best") or {}).get("epoch")] + [e["epoch"] for e in state.get("ranked") or []]
        try:
            self.link(LAST_LINK, name)
            if is_best:
                self.link(BEST_LINK, name)
            self._remove_superseded(keep={name} | {self.point_name(e) for e in ranked if e is not None})
        except OSError as e:  # the point itself is complete: --resume auto finds it by its name
            raise StorageError(f"updating checkpoints/last after writing {name} failed ({storage_reason(e)})") from None
        return final

    def link(self, link_name: str, target: str) -> Path | None:
        """Point ``checkpoints/<link_name>`` at ``target`` (a single rename). Something else in the link's
        place (a copied folder, as ``cp -rL`` makes) is renamed ``<link_name>.copy`` and returned."""
        path, tmp = self.root / link_name, self.root / staging_name(link_name)
        moved = None
        if path.is_symlink() and os.readlink(path) == target:
            return None
        if path.exists() and not path.is_symlink():
            moved = self.set_aside(path, ".copy")
        try:
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            os.symlink(target, tmp)
            file_system().replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        return moved

    def relink(self, last: str, best: str | None) -> list[str]:
        """Regenerate the links from the training state (on resume): notes for what was not as it should be."""
        notes = []
        for link_name, target in zip(LINKS, (last, best)):
            path = self.root / link_name
            if (
                target is None
                or not (self.root / target).is_dir()
                or (path.is_symlink() and os.readlink(path) == target)
            ):
                continue
            if path.is_symlink():
                state = f"pointing at {os.readlink(path)}"
            else:
                state = "not a link" if path.exists() else "missing"
            moved = self.link(link_name, target)
            kept = f"; kept what was there as {moved.name}" if moved else ""
            notes.append(
                f"{CHECKPOINTS_DIR}/{link_name} was {state}: pointed it at {target}, as the training state records{kept}"
            )
        return notes

    def _remove_superseded(self, keep: set[str]) -> None:
        """Delete the engine's own points beyond the newest ``keep`` (``keep`` names stay: the newest point
        and the recorded best ones)."""
        owned = [p for p in self.points() if self._owned(p)]
        for path in owned[self.keep :]:
            if path.name not in keep:
                self._discard(path)

    def _discard(self, point: Path) -> None:
        """Rename ``point`` to its staging name, then delete it: a command reading the run meanwhile finds the
        whole point or none of it, never a point with some of its files gone (engine.rundir.reader)."""
        staging = self._staging(point.name)
        shutil.rmtree(staging, ignore_errors=True)
        try:
            file_system().rename(point, staging)
        except OSError:  # kept: nothing is deleted that was not first set apart whole
            return
        shutil.rmtree(staging, ignore_errors=True)

    def save_snapshot(self, epoch: int, weights: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
        """``--save-epochs``: a weights-only copy that the rotation never deletes, listed with its size and
        sha256 in ``snapshots.json`` (what ``verify_snapshot`` checks). The listing is read (``check_snapshots``)
        before anything is written: a damaged one, or a link or FIFO in its place, is a DamagedCheckpointError
        naming it (exit 65), never a listing started over."""
        self.root.mkdir(parents=True, exist_ok=True)
        path, listing = self.root / snapshot_file(epoch), self.root / SNAPSHOTS_FILE
        entries = check_snapshots(self.root)
        try:
            save_weights(weights, path, metadata, owner=self.root.parent)
            entries = {**entries, path.name: file_entry(path)}
            write_text(listing, json.dumps(entries, indent=1) + "\n", self.root.parent)
        except WRITE_ERRORS as e:
            reason = storage_reason(e, self.root, payload_bytes(weights))
            raise StorageError(f"writing the snapshot {path.name} failed ({reason})") from None
        return path
