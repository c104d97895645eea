"""Every process's random streams (python, numpy, torch, cuda) in a form ``torch.load(weights_only=True)`` reads."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


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
