"""Checkpoints: atomic writes, safetensors weights, resumable training state, safe loading.

Layout of ``<output>/checkpoints``::

    epoch_0007/             one complete resume point (written as .epoch_0007.tmp, then renamed)
    epoch_0007_step_0000120/  a mid-epoch resume point: 120 steps into the 8th epoch (preemption,
                            --checkpoint-interval); its training_state.pt also holds the step and the
                            loss accumulators
        model.safetensors   model weights (metadata: model name, epoch)
        ema.safetensors     EMA weights, with --model-ema
        training_state.pt   optimizer, scheduler, grad scaler, counters, RNG states of every rank
    last -> epoch_0007      symlinks, swapped atomically (os.replace)
    best -> epoch_0005
    epoch_5.safetensors     --save-epochs snapshots (weights only)

A kill at any moment leaves ``last`` pointing at a complete directory: the new directory is only
renamed into place once fully written, and the symlink swap is a single rename. Directories that
neither ``last`` nor ``best`` points to are deleted after the swap.

Loading never unpickles arbitrary objects: weights come from safetensors, and ``.pt`` files are read
with ``torch.load(weights_only=True)`` (tensors and plain containers only).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from convbias.weights import (  # noqa: F401  (the engine's loading API is the shared one)
    WEIGHTS_FILE,
    check_compatible,
    load_weights,
    read_state_dict,
    resolve_weights_path,
    weights_metadata,
)

EMA_FILE = "ema.safetensors"
STATE_FILE = "training_state.pt"


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)``, then rename tmp_path over ``path``: readers see the old or the new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


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


# ------------------------------------------------------------------------------ resume points on disk
class CheckpointDir:
    """The ``checkpoints/`` folder of a run: write resume points, keep last and best, find them again."""

    def __init__(self, output: str | Path):
        self.root = Path(output) / "checkpoints"

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
        if final.exists():  # left over from a run killed after the rename but before the link swap
            shutil.rmtree(final)
        os.rename(tmp, final)
        self._point("last", name)
        if is_best:
            self._point("best", name)
        self._remove_unreferenced()
        return final

    def _point(self, link_name: str, target: str) -> None:
        tmp = self.root / f".{link_name}.tmp"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(target, tmp)
        os.replace(tmp, self.root / link_name)

    def _remove_unreferenced(self) -> None:
        keep = {p.name for p in (self.last, self.best) if p is not None}
        for path in self.root.glob("epoch_*"):
            if path.is_dir() and path.name not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def save_snapshot(self, epoch: int, weights: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
        """``--save-epochs``: a weights-only copy that the last/best rotation never deletes."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"epoch_{epoch}.safetensors"
        save_weights(weights, path, metadata)
        return path


def find_resume_point(resume: str, output: str | Path) -> Path | None:
    """The checkpoint directory ``--resume`` names; None for 'auto' in a run dir without checkpoints.

    Raises ValueError for an explicit path that holds no resume point.
    """
    if resume == "auto":
        return CheckpointDir(output).last
    path = Path(resume)
    for candidate in (path, path / "last", path / "checkpoints" / "last"):
        if (candidate / STATE_FILE).is_file() and (candidate / WEIGHTS_FILE).is_file():
            return candidate.resolve()
    raise ValueError(
        f"--resume {resume}: no checkpoint there (expected a run dir with checkpoints/last/, "
        f"or a checkpoint dir holding {WEIGHTS_FILE} and {STATE_FILE})"
    )


def load_training_state(point: Path) -> dict[str, Any]:
    """The training state of a resume point, loaded with weights_only=True."""
    try:
        return torch.load(point / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"cannot read {point / STATE_FILE} ({str(e).splitlines()[0]})") from None
