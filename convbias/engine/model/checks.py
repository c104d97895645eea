"""The model package's checks of a run's options, before any work starts: the torch.compile backend."""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ..config.options import Config


def check(cfg: Config) -> None:
    """ConfigError when --compile names a backend torch.compile does not have."""
    if not cfg.compile:
        return
    backends = torch.compiler.list_backends(exclude_tags=())
    if cfg.compile_backend not in backends:
        raise ConfigError(f"unknown --compile-backend '{cfg.compile_backend}'; choices: {', '.join(backends)}")
