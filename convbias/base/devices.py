"""The devices a command may be told to run on (``--device``), checked against this machine before any work.

torch is imported inside functions: a command's parser names this check, and ``--help`` loads no torch.
"""

from __future__ import annotations

import re

from .errors import ConfigError

DEVICE_FORMS = "cpu, cuda or cuda:N"
_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def default_device() -> str:
    """cuda when this machine has a CUDA device, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(name: str) -> str:
    """``name`` when it is a device of this machine (cpu, cuda, cuda:N with N below the CUDA device count);
    ConfigError saying why not otherwise."""
    match = _DEVICE.fullmatch(name)
    if match is None or (match[1] == "cpu" and match[2] is not None):
        raise ConfigError(f"expected {DEVICE_FORMS}, got {name!r}")
    if match[1] == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{name}: no CUDA device is available here (use cpu)")
        if match[2] is not None and int(match[2]) >= count:
            raise ConfigError(f"{name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return name
