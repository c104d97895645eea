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
    """timm.create_model with the run's model options (model, model_kwargs, img_size, drop, drop_path, pretrained,
    pretrained_file, head_init_scale); pretrained weights come from a local file only."""
    kwargs: dict[str, Any] = dict(
        num_classes=num_classes,
        drop_rate=cfg.drop or None,  # None: not passed, for the models that take no dropout rate
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
            model = timm.create_model(cfg.model, **kwargs)
        except TypeError as e:  # CNNs take no img_size: they run at any resolution
            if "img_size" not in str(e) or "img_size" in model_kwargs:
                raise
            kwargs.pop("img_size")
            model = timm.create_model(cfg.model, **kwargs)
    except (TypeError, ValueError, RuntimeError, FileNotFoundError) as e:
        given = {**({"drop_rate": cfg.drop} if cfg.drop else {}), **model_kwargs}
        raise ConfigError(
            f"cannot build {cfg.model} with {given or 'default arguments'}: {str(e).splitlines()[0]}"
        ) from e  # the constructor's traceback, shown with CONVBIAS_TRACEBACK=1
    if cfg.head_init_scale is not None:
        scale_classifier(model, cfg.head_init_scale, cfg.model)
    return model


def scale_classifier(model: torch.nn.Module, scale: float, name: str) -> None:
    """--head-init-scale: the classifier's weight and bias (every head's, for a distilled model's pair) times
    ``scale``, as timm's train.py does after creating the model (a small head starts fine-tuning near uniform
    predictions)."""
    if not hasattr(model, "get_classifier"):
        raise ConfigError(f"--head-init-scale: {type(model).__name__} ({name}) has no get_classifier(); run without it")
    heads = model.get_classifier()
    heads = heads if isinstance(heads, (tuple, list)) else (heads,)
    weights = [getattr(head, key, None) for head in heads for key in ("weight", "bias")]
    weights = [w for w in weights if isinstance(w, torch.Tensor)]
    if not weights:
        raise ConfigError(f"--head-init-scale: the classifier of {name} ({heads[0]}) has no weight to scale")
    with torch.no_grad():
        for weight in weights:
            weight.mul_(scale)
