"""The model package's checks of a run's options, before any work starts: the torch.compile backend, and the
model names once the families have registered theirs."""

from __future__ import annotations

import torch

from convbias.base.errors import ConfigError

from ..config.options import Config
from .factory import check_model_name


def check(cfg: Config) -> None:
    """ConfigError when --compile names a backend torch.compile does not have."""
    if not cfg.compile:
        return
    backends = torch.compiler.list_backends(exclude_tags=())
    if cfg.compile_backend not in backends:
        raise ConfigError(f"unknown --compile-backend '{cfg.compile_backend}'; choices: {', '.join(backends)}")


def check_names(cfg: Config) -> None:
    """ConfigError naming close registry entries when --model or --distill-teacher is not a timm model."""
    check_model_name(cfg.model)
    if cfg.distill_teacher:
        check_model_name(cfg.distill_teacher, "--distill-teacher")
