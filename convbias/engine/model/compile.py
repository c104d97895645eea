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

On a CPU, inductor's own code loses to eager in two places (docs/benchmarks.md): its generated kernels
for GELU, LayerNorm, max-pool and ReLU's saved mask are slower than ATen's (`aten_kernels`), and its
layout optimization moves a small CNN's convolutions to channels-last, where oneDNN runs them slower. So on a CPU the engine compiles with inductor's
``layout_optimization`` option off (a documented ``torch.compile`` option) and routes those modules
through `aten_kernels.use_aten_kernels`, which keeps eager's numerics for them. On a GPU
``torch.compile`` runs as PyTorch ships it.

dynamo's and inductor's modules are imported inside functions: a run without ``--compile`` loads neither.
"""

from __future__ import annotations

from typing import Any

import torch

from .aten_kernels import use_aten_kernels

CPU_INDUCTOR_OPTIONS = {"layout_optimization": False}  # see the module docstring


def compile_model(
    module: Any,
    device_type: str,
    backend: str = "inductor",
    mode: str = "default",
    aten_kernels: bool = True,
    fullgraph: bool = False,
) -> Any:
    """``torch.compile(module)`` as the engine runs it on `device_type` ('cpu', 'cuda'); on a CPU with
    inductor, `aten_kernels` (the default) gives the CPU treatment of the module docstring, and False
    plain ``torch.compile`` (what benchmarks/compile_speedup.py compares it with). `fullgraph` as in
    ``torch.compile`` (tests: a graph break raises)."""
    if device_type == "cpu" and backend == "inductor" and aten_kernels:
        from torch._inductor import list_mode_options  # named in torch.compile's documentation of `mode`

        use_aten_kernels(module)
        options = {**list_mode_options(mode), **CPU_INDUCTOR_OPTIONS}
        return torch.compile(module, backend=backend, options=options, fullgraph=fullgraph)
    return torch.compile(module, backend=backend, mode=None if mode == "default" else mode, fullgraph=fullgraph)


def compiled(module: Any, cfg: Any, device_type: str) -> Any:
    """`compile_model` with the run's --compile-backend and --compile-mode; module itself without --compile."""
    if not cfg.compile:
        return module
    return compile_model(module, device_type, cfg.compile_backend, cfg.compile_mode)


def compile_counters() -> dict[str, int]:
    """dynamo's process-wide counters: graphs compiled so far and graph breaks (logged each epoch, so a
    recompilation in a later epoch shows up in log.jsonl)."""
    from torch._dynamo.utils import counters

    return {
        "compiled_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }
