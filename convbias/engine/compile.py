"""``--compile``: torch.compile for the engine's training and evaluation forwards, and nothing else.

The engine keeps two handles on a model: the prepared module (DDP or bare), which checkpoints, EMA,
reparametrizations and diagnostics use, and a compiled *view* of it (``torch.compile(prepared)``) that
only the training step and ``evaluate`` call. Hence

- checkpoints hold the model's own keys (no ``_orig_mod.`` prefix): a compiled run's files load
  everywhere an eager run's do, and a compiled run resumes an eager one and vice versa;
- the diagnostics run eagerly on the unwrapped module: their explicit attention paths and hooks are
  never traced;
- one compilation serves every epoch: train and eval modes are two cached graphs (timm's blocks are
  inlined, so the block loop costs no recompilation); a reparametrization compiles the new model once.

DDP is compiled from the outside (``torch.compile(ddp_model)``), as PyTorch recommends, so dynamo's
DDP optimizer splits the graph at bucket boundaries and gradient all-reduce still overlaps backward.
"""
from __future__ import annotations

from typing import Any

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compiled(module: Any, cfg: Any) -> Any:
    """``torch.compile(module)`` with the run's --compile-backend and --compile-mode; module itself without --compile."""
    if not cfg.get("compile"):
        return module
    import torch  # here, not at the top: config.py imports COMPILE_MODES and `train.py --help` loads no torch

    mode = cfg.get("compile_mode") or "default"
    return torch.compile(module, backend=cfg.get("compile_backend") or "inductor",
                         mode=None if mode == "default" else mode)


def compile_counters() -> dict[str, int]:
    """dynamo's process-wide counters: graphs compiled so far and graph breaks (logged each epoch, so a
    recompilation in a later epoch shows up in log.jsonl)."""
    from torch._dynamo.utils import counters

    return {"compiled_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}
