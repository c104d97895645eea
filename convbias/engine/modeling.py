"""Building a model from a run's options through timm's registry (the only way the engine makes models).

The registry must already hold the model: the composition root imports the families first.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import timm
import torch

from convbias.weights import check_weights_file

from ..errors import ConfigError
from .options import Config


def check_model_name(name: str, option: str = "--model") -> None:
    """ConfigError naming close registry entries when `name` is not a timm model."""
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.5)
        hint = f"; close choices: {', '.join(close)}" if close else "; see timm.list_models()"
        raise ConfigError(f"unknown model '{name}' for {option}{hint}")


def create_model(cfg: Config, num_classes: int, in_chans: int) -> torch.nn.Module:
    """timm.create_model with the run's model options (model, model_kwargs, img_size, drop_path, pretrained,
    pretrained_file); pretrained weights come from a local file only."""
    kwargs: dict[str, Any] = dict(
        num_classes=num_classes,
        drop_path_rate=cfg.drop_path or None,
        in_chans=None if in_chans == 3 else in_chans,
        pretrained=bool(cfg.pretrained),
    )
    if cfg.pretrained_file:
        try:
            check_weights_file(cfg.pretrained_file)
        except ValueError as e:
            raise ConfigError(f"--pretrained-file: {e}") from None
        kwargs["pretrained_cfg_overlay"] = dict(file=str(Path(cfg.pretrained_file).resolve()))
    model_kwargs = dict(cfg.model_kwargs or {})
    kwargs.update(model_kwargs)
    kwargs.setdefault("img_size", cfg.img_size)
    try:
        try:
            return timm.create_model(cfg.model, **kwargs)
        except TypeError as e:  # CNNs take no img_size: they run at any resolution
            if "img_size" not in str(e) or "img_size" in model_kwargs:
                raise
            kwargs.pop("img_size")
            return timm.create_model(cfg.model, **kwargs)
    except (TypeError, ValueError, RuntimeError, FileNotFoundError) as e:
        raise ConfigError(
            f"cannot build {cfg.model} with {model_kwargs or 'default arguments'}: {str(e).splitlines()[0]}"
        ) from e  # the constructor's traceback, shown with CONVBIAS_TRACEBACK=1
