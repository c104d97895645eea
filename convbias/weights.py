"""Weight files: read a state dict safely, check it fits a model, load it (shared by the engine and the families).

Loading never unpickles arbitrary objects: weights come from safetensors, and ``.pt`` files are read
with ``torch.load(weights_only=True)`` (tensors and plain containers only). Every failure is a
ValueError whose one-line message names the file and what is wrong with it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from convbias.errors import ConfigError

WEIGHTS_FILE = "model.safetensors"
MAX_KEYS_SHOWN = 5


def resolve_weights_path(path: str | Path) -> Path:
    """A weights file, or a checkpoint dir (its model.safetensors). A train.py run directory is read through
    ``convbias.engine.RunDir``, which picks a verified point: here it is named as such."""
    path = Path(path)
    if path.is_dir():
        if (path / WEIGHTS_FILE).is_file():
            return path / WEIGHTS_FILE
        if (path / "checkpoints").is_dir():
            raise ConfigError(
                f"{path} is a run directory: give one of its checkpoints ({path}/checkpoints/epoch_NNNN/"
                f"{WEIGHTS_FILE}), or the run itself where a command takes a run (--checkpoint RUN, --eval-only RUN)"
            )
        raise ConfigError(f"no weights in {path} (expected {WEIGHTS_FILE} in it)")
    if not path.is_file():
        raise ConfigError(f"weights file not found: {path}")
    return path


# Types allowed in a torch file besides tensors and plain containers: timm's train.py saves its arguments (an
# argparse.Namespace of plain values) in every checkpoint (checkpoint-N.pth.tar, model_best.pth.tar, last.pth.tar)
SAFE_GLOBALS = [argparse.Namespace]


def load_torch_file(path: str | Path) -> Any:
    """A torch file's content with weights_only=True: tensors, plain containers and SAFE_GLOBALS only, nothing
    executed (torch's allow-list); no fallback to full unpickling."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(path, map_location="cpu", weights_only=True)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Weights from a file or a directory (see resolve_weights_path), without unpickling arbitrary objects.

    Reads ``.safetensors``, or a torch file (``.pt``/``.pth``/``.bin``, timm's ``.pth.tar``) with weights_only=True
    (load_torch_file), unwrapping ``{'model': ...}``/``{'state_dict': ...}`` (timm's checkpoints: the model's
    weights, not its EMA's, as timm's load_checkpoint by default) and a DDP ``module.`` prefix.
    """
    path = resolve_weights_path(path)
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ConfigError(f"{path} is not a readable safetensors file ({e})") from None
    try:
        obj = load_torch_file(path)
    except Exception:  # torch's message invites unpickling the file with weights_only=False: not ours to give
        raise ConfigError(
            f"{path} cannot be read as weights with weights_only=True (it is damaged, or holds Python objects "
            f"besides tensors); it was not unpickled"
        ) from None
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def _shown(keys: list[str]) -> str:
    more = f" (+{len(keys) - MAX_KEYS_SHOWN} more)" if len(keys) > MAX_KEYS_SHOWN else ""
    return ", ".join(keys[:MAX_KEYS_SHOWN]) + more


def check_compatible(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise ValueError naming missing, unexpected and shape-mismatched keys."""
    check_keys(model.state_dict(), state_dict, source, type(model).__name__)


def check_keys(
    expected: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor], source: str, model_name: str
) -> None:
    """check_compatible against the tensors `expected` (a model's state dict, or part of it)."""
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    mismatched = [
        f"{k} {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state_dict and state_dict[k].shape != v.shape
    ]
    problems = [
        f"{label}: {_shown(keys)}"
        for label, keys in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("mismatched shapes", mismatched),
        )
        if keys
    ]
    if problems:
        raise ConfigError(f"{source} does not fit this model ({model_name}): " + "; ".join(problems))


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
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ConfigError(f"{path} is not a readable safetensors file ({e})") from None


def check_weights_file(path: str | Path) -> None:
    """ValueError naming ``path`` unless it reads as weights (a safetensors header, or a torch state dict):
    for files handed to a library that would fail with a traceback (timm's pretrained_cfg file)."""
    path = resolve_weights_path(path)
    if path.suffix == ".safetensors":
        weights_metadata(path)
    else:
        read_state_dict(path)
