"""Sharded resume points for FSDP2 (``fully_shard``) models: torch.distributed.checkpoint (DCP).

Under FSDP every rank holds a shard of the weights and of the optimizer state. ``save_sharded`` writes
both, each rank its own shard, through DCP into ``<point>/sharded/`` of a resume point being written;
``load_sharded`` reads them back into a model and optimizer sharded the same way. DCP stores global
tensors with their shard layout, so the *weights* also load on another number of processes, or into
an unsharded model on one process (``load_full_weights``): a run can move to fewer or more GPUs from
its weights; exact continuation (optimizer state, RNG streams, sampler position) needs the same world.

Atomicity comes from the resume point itself (engine.checkpoint.points: written under a temporary name,
renamed when complete), so a killed save never leaves a ``last`` that points at a partial shard set.

A sharded point also resumes without FSDP (one process, or DDP): DCP reads the global tensors into
ordinary ones.

``FullCopy`` is what the EMA update and the diagnostics read under FSDP: an ordinary copy of the model
on every rank, refreshed from the shards (an all-gather of the fp32 weights, not of the low-precision
copies FSDP's mixed precision computes with).

Tested on CPU with 2 gloo processes below accelerate (tests/engine/checkpoint/test_fsdp.py): accelerate 1.15 enables FSDP
only for GPU-like devices; with ``ACCELERATE_USE_CPU=1 accelerate launch --use_fsdp --fsdp_version 2``
it silently falls back to DDP (``AcceleratorState`` keeps ``DistributedType.MULTI_CPU``). The engine
under accelerate's FSDP2 is tested on a GPU (tests/engine/loop/test_train_fsdp.py, skipped without one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from convbias.base.errors import ConfigError
from convbias.base.run_layout import SHARDED_DIR, SHARDED_METADATA


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{'model': ..., 'optimizer': ...} as DTensor shards, keyed by parameter names (not ids)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save_sharded(point: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Path:
    """Every rank writes its shards of the model (and optimizer) into ``point/sharded`` (a collective)."""
    directory = Path(point) / SHARDED_DIR
    dcp.save(sharded_state(model, optimizer), checkpoint_id=str(directory))
    return directory


def load_sharded(point: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load ``point/sharded`` into a model (and optimizer) sharded like the run's (a collective)."""
    directory = Path(point) / SHARDED_DIR
    if not (directory / SHARDED_METADATA).is_file():
        raise ConfigError(
            f"{directory}: no sharded checkpoint there (expected DCP's {SHARDED_METADATA} and one "
            f"__<rank>_0.distcp file per writing process)"
        )
    state = sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}))


def load_full_weights(point: str | Path, model: torch.nn.Module) -> None:
    """The weights of a sharded resume point into an ordinary (unsharded) model, in one process,
    whatever the number of processes that wrote it."""
    directory = Path(point) / SHARDED_DIR
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    model.load_state_dict(state["model"])
