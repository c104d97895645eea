"""timm's training checkpoints (``last.pth.tar``, ``model_best.pth.tar``, ``checkpoint-N.pth.tar``), read safely.

timm's train.py saves, through ``timm.utils.CheckpointSaver``, one dict per file: ``state_dict`` (the model),
``optimizer`` (its ``state_dict()``), ``state_dict_ema`` (with --model-ema), ``amp_scaler`` (with AMP), ``epoch``
(0-based index of the epoch just trained), ``version`` (2: ``epoch`` is the one trained, not the next), ``arch``,
``args`` (its ``argparse.Namespace``) and ``metric``. The file is read with ``weights_only=True`` and the
``argparse.Namespace`` allow-list (``convbias.base.weights.load_torch_file``); nothing in it is executed.

A file is taken for timm's when its name ends in one of ``TIMM_SUFFIXES`` (what ``--resume``, convbias-predict and
convbias-export tell from a run directory by); it must then hold ``state_dict`` and ``epoch``, else it is refused
as damaged or foreign (exit 65).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from timm.data import resolve_data_config

from convbias.base.class_map import read_class_map
from convbias.base.errors import ConfigError, DamagedInputError
from convbias.base.inputs import quoted
from convbias.base.weights import load_torch_file

from ..config.options import option_names
from ..config.parsing import check_option, coerce, require

SCALER_KEY = "amp_scaler"  # timm.utils.NativeScaler.state_dict_key: torch's GradScaler state
# Optimizer defaults that newer torch and timm versions added, filled in with their defaults where an older file
# lacks them: their absence is no sign of another optimizer
IMPLEMENTATION_FLAGS = frozenset(
    {
        "foreach",
        "fused",
        "differentiable",
        "capturable",
        "maximize",
        "decoupled_weight_decay",
        "caution",
        "corrected_weight_decay",
    }
)


@dataclass
class TimmCheckpoint:
    """What a timm training checkpoint holds, as timm's resume_checkpoint and load_checkpoint read it."""

    path: Path
    state_dict: dict[str, torch.Tensor]
    epoch: int  # as saved: the 0-based epoch just trained (version 2), or the next one (older files)
    version: int
    ema_state_dict: dict[str, torch.Tensor] | None = None
    optimizer: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    args: dict[str, Any] = field(default_factory=dict)  # train.py's arguments ({} when the file has none)
    metric: float | None = None

    @property
    def resume_epoch(self) -> int:
        """The 0-based epoch training continues with, as timm's resume_checkpoint returns it: ``epoch`` + 1,
        or ``epoch`` itself in files older than version 2 (they saved the next epoch)."""
        return self.epoch + 1 if self.version > 1 else self.epoch

    def weights(self, use_ema: bool = False) -> dict[str, torch.Tensor]:
        """The model's weights, or with ``use_ema`` its EMA's (a ConfigError when the file has none)."""
        if not use_ema:
            return self.state_dict
        if self.ema_state_dict is None:
            raise ConfigError(f"--use-ema: {self.path} holds no state_dict_ema (its run had no --model-ema)")
        return self.ema_state_dict


def _state_dict(obj: Any) -> dict[str, torch.Tensor] | None:
    """A state dict of tensors with timm's clean_state_dict prefixes removed, or None when ``obj`` is not one."""
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        return None
    prefixes = ("_orig_mod.", "module.", "_orig_mod.")  # torch.compile and DDP wrappers, in either order
    cleaned = {}
    for key, value in obj.items():
        for prefix in prefixes:
            key = key.removeprefix(prefix)
        cleaned[key] = value
    return cleaned


def read_timm_checkpoint(path: str | Path) -> TimmCheckpoint:
    """The content of timm's training checkpoint ``path``, read safely; DamagedInputError (exit 65) naming the
    file when it does not read with weights_only=True or lacks ``state_dict`` and ``epoch``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"timm checkpoint not found: {path}")
    content = load_torch_file(path, "timm's checkpoint")
    state_dict = _state_dict(content.get("state_dict")) if isinstance(content, dict) else None
    epoch = content.get("epoch") if isinstance(content, dict) else None
    if state_dict is None or not isinstance(epoch, int) or isinstance(epoch, bool):
        raise DamagedInputError(
            f"{path} is not a timm training checkpoint: expected a dict with 'state_dict' (tensors) and 'epoch', "
            f"as timm's CheckpointSaver writes"
        )
    args = content.get("args")
    args = vars(args) if isinstance(args, argparse.Namespace) else dict(args) if isinstance(args, dict) else {}
    check_args(args, path)
    optimizer = content.get("optimizer")
    version = content.get("version", 1)
    return TimmCheckpoint(
        path=path,
        state_dict=state_dict,
        epoch=epoch,
        version=version if isinstance(version, int) else 1,
        ema_state_dict=_state_dict(content.get("state_dict_ema")),
        optimizer=optimizer if isinstance(optimizer, dict) and "param_groups" in optimizer else None,
        scaler=content.get(SCALER_KEY) if isinstance(content.get(SCALER_KEY), dict) else None,
        args=args,
        metric=content.get("metric") if isinstance(content.get("metric"), (int, float)) else None,
    )


# The fields of timm's saved args that building, evaluating and labelling its model read (create_timm_model,
# timm_data_config, timm_class_names), each checked as this engine's option of the same name checks it; the
# input size and channels only for their type and sign (this engine's own runs are square, 1 or 3 channels,
# timm's need not be)
ARGS_READ = (
    "model",
    "num_classes",
    "in_chans",
    "input_size",
    "img_size",
    "gp",
    "bn_eps",
    "model_kwargs",
    "mean",
    "std",
    "crop_pct",
    "crop_mode",
    "interpolation",
    "class_map",
)
ANY_SHAPE = ("in_chans", "input_size")


def image_channels(args: dict[str, Any]) -> int:
    """The channels of the images timm's train.py trained on: --in-chans, else --input-size's first, else 3."""
    input_size = args.get("input_size")
    return args.get("in_chans") or (input_size[0] if input_size else 3)


def check_args(args: dict[str, Any], path: Path) -> None:
    """DamagedInputError (exit 65) naming the checkpoint and the field (``args.interpolation``) when a field of
    ``ARGS_READ`` holds what its option refuses (timm's '' and None mean unset); a class map it names is read as
    ``--class-map`` reads one (a FIFO or device never opened)."""
    for key in ARGS_READ:
        value = args.get(key)
        if key not in option_names() or value in ("", None):
            continue
        label = f"{path}: args.{key}"
        try:
            value = coerce(key, value, label)
            if key in ANY_SHAPE:
                values = value if isinstance(value, list) else [value]
                require(all(v >= 1 for v in values), f"{label} must be positive, got {quoted(value)}")
            else:
                check_option(key, value, label)
            if key == "class_map" and os.path.lexists(value) and Path(value).suffix.lower() == ".txt":
                read_class_map(value)  # one that is not here (trained elsewhere) leaves the labels as indices
        except ConfigError as error:
            message = str(error) if str(error).startswith(label) else f"{label}: {error}"
            raise DamagedInputError(message) from None
    channels = image_channels(args)
    for key in ("mean", "std"):  # one value per channel, as timm's normalization takes them
        value = args.get(key)
        if isinstance(value, (list, tuple)) and len(value) not in (1, channels):
            raise DamagedInputError(
                f"{path}: args.{key} has {len(value)} values for {channels}-channel images: {quoted(list(value))}"
            )


def timm_data_config(checkpoint: TimmCheckpoint, model: torch.nn.Module) -> dict[str, Any]:
    """The evaluation preprocessing of ``checkpoint``'s run: timm's ``resolve_data_config`` of its arguments and
    model, as timm's train.py evaluated and timm's inference.py predicts (the train-time input size)."""
    return resolve_data_config(checkpoint.args, model=model)


def timm_class_names(checkpoint: TimmCheckpoint, num_classes: int) -> tuple[list[str] | None, list[str]]:
    """The class names of the run's --class-map (a .txt file of one name per line, timm's format) when it is named
    and can be read here with as many names as classes, else None and why (labels are then class indices)."""
    class_map = checkpoint.args.get("class_map")
    if not class_map:
        return None, [f"{checkpoint.path} names no --class-map: labels are class indices"]
    path = Path(class_map)
    if path.suffix.lower() != ".txt":
        return None, [f"its --class-map {class_map} is not a .txt file of names: labels are class indices"]
    if not os.path.lexists(path):
        return None, [f"its --class-map {class_map} is not here: labels are class indices"]
    try:  # as --class-map reads one: a regular file, line i naming class i
        mapping = read_class_map(path)
    except ConfigError as error:
        raise DamagedInputError(f"{checkpoint.path}: args.class_map: {error}") from None
    names = sorted(mapping, key=mapping.__getitem__)
    if len(names) != num_classes:
        return None, [f"its --class-map {class_map} has {len(names)} names, the model {num_classes} classes"]
    return names, []
