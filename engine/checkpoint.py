"""Checkpoints: atomic writes, safetensors weights, resumable training state, safe loading.

Layout of ``<output>/checkpoints``::

    epoch_0007/             one complete resume point (written as .epoch_0007.tmp, then renamed)
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
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "model.safetensors"
EMA_FILE = "ema.safetensors"
STATE_FILE = "training_state.pt"
MAX_KEYS_SHOWN = 5


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


def resolve_weights_path(path: str | Path) -> Path:
    """A weights file, a checkpoint dir (its model.safetensors) or a run dir (checkpoints/best, else last)."""
    path = Path(path)
    if path.is_dir():
        for candidate in (path / WEIGHTS_FILE, path / "checkpoints" / "best" / WEIGHTS_FILE,
                          path / "checkpoints" / "last" / WEIGHTS_FILE):
            if candidate.is_file():
                return candidate
        raise ValueError(f"no weights in {path} (expected {WEIGHTS_FILE} or checkpoints/best/{WEIGHTS_FILE})")
    if not path.is_file():
        raise ValueError(f"weights file not found: {path}")
    return path


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Weights from a file or a directory (see resolve_weights_path), without unpickling arbitrary objects.

    Reads ``.safetensors``, or a torch file (``.pt``/``.pth``/``.bin``) with weights_only=True, unwrapping
    ``{'model': ...}``/``{'state_dict': ...}`` and a DDP ``module.`` prefix.
    """
    path = resolve_weights_path(path)
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a weights file loadable with weights_only=True ({str(e).splitlines()[0]})") from None
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def _shown(keys: list[str]) -> str:
    more = f" (+{len(keys) - MAX_KEYS_SHOWN} more)" if len(keys) > MAX_KEYS_SHOWN else ""
    return ", ".join(keys[:MAX_KEYS_SHOWN]) + more


def check_compatible(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise ValueError naming missing, unexpected and shape-mismatched keys."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    mismatched = [f"{k} {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
                  for k, v in expected.items() if k in state_dict and state_dict[k].shape != v.shape]
    problems = [f"{label}: {_shown(keys)}" for label, keys in
                (("missing keys", missing), ("unexpected keys", unexpected), ("mismatched shapes", mismatched)) if keys]
    if problems:
        raise ValueError(f"{source} does not fit this model ({type(model).__name__}): " + "; ".join(problems))


def load_weights(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Load weights written by train.py (or any safetensors / torch state-dict file) into ``model``.

    Raises ValueError naming the missing, unexpected or mismatched keys when the file belongs to
    another model. Returns the model.
    """
    state_dict = read_state_dict(path)
    check_compatible(model, state_dict, str(path))
    model.load_state_dict(state_dict, strict=True)
    return model


def weights_metadata(path: str | Path) -> dict[str, str]:
    """The metadata stored in a safetensors header (model name, epoch), {} for other files."""
    path = resolve_weights_path(path)
    if path.suffix != ".safetensors":
        return {}
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


# ----------------------------------------------------------------------------------------- RNG states
def rng_state() -> dict[str, Any]:
    """This process's RNG states in weights_only-loadable types (tensors, ints, tuples)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])),
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

    def save(self, epoch: int, weights: dict[str, torch.Tensor], state: dict[str, Any],
             ema_weights: dict[str, torch.Tensor] | None, metadata: dict[str, str], is_best: bool) -> Path:
        """Write the resume point after ``epoch`` completed epochs, point ``last`` (and ``best``) at it."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"epoch_{epoch:04d}"
        final, tmp = self.root / name, self.root / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()},
                  str(tmp / WEIGHTS_FILE), metadata=metadata)
        if ema_weights is not None:
            save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in ema_weights.items()},
                      str(tmp / EMA_FILE), metadata=metadata)
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
    raise ValueError(f"--resume {resume}: no checkpoint there (expected a run dir with checkpoints/last/, "
                     f"or a checkpoint dir holding {WEIGHTS_FILE} and {STATE_FILE})")


def load_training_state(point: Path) -> dict[str, Any]:
    """The training state of a resume point, loaded with weights_only=True."""
    try:
        return torch.load(point / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"cannot read {point / STATE_FILE} ({str(e).splitlines()[0]})") from None
