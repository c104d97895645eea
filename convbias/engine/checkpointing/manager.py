"""What the training loop saves and loads: one ``CheckpointManager`` per run.

The trainer constructs it with the run's stateful parts and calls ``load()`` once (the resume point that
engine.loop.start found, into the parts) and ``save(epoch, step)`` after every epoch and every optimizer
update. The manager owns the rest: the parts a resume point holds (``RESUME_PART_TYPES``, ``parts()``),
when a mid-epoch point is due (--checkpoint-interval, a preemption), the weights' metadata, every rank's FSDP
shards, and, through ``CheckpointDir`` (engine.checkpointing.points), staging, manifests, the ``last`` /
``best`` links, rotation and the --save-epochs snapshots.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate.utils import broadcast_object_list, gather_object
from torch.distributed.checkpoint.api import CheckpointException

from convbias.base.errors import StorageError
from convbias.base.run_layout import EMA_FILE
from convbias.base.storage import storage_reason
from convbias.base.weights import load_weights

from .points import CheckpointDir
from .shards import load_sharded, save_sharded
from .state_parts import (
    AugmentStreams,
    OptimizerAndScheduler,
    OptimizerState,
    ProcessContext,
    RandomStreams,
    RunIdentity,
    SchedulerState,
    Stateful,
    TrainingProgress,
    exact_options,
    restore,
    resume_state,
)

# The parts a resume point holds, by name (engine.checkpointing.state_parts; the weights are files beside them).
# Each class declares the options that a mid-epoch point must be continued with (its exact_options).
RESUME_PART_TYPES = {
    "identity": RunIdentity,
    "progress": TrainingProgress,
    "optimizer": OptimizerState,
    "scheduler": SchedulerState,
    "rng": RandomStreams,
    "augment": AugmentStreams,
}


class CheckpointedRun(ProcessContext, Protocol):
    """What the manager reads of the run (engine.loop.setup.RunStart is one)."""

    output: Path
    sharded: bool  # FSDP: weights and optimizer state are every rank's shards
    resume_point: Path | None
    resume_state: dict[str, Any] | None


class CheckpointedModels(Protocol):
    """The run's models (engine.loop.setup.Models is one): attributes, since a reparametrization replaces them."""

    model: torch.nn.Module  # as accelerate prepared it
    ema: Any  # timm's ModelEmaV3, or None


class CheckpointManager:
    """A run's resume points: ``load()`` once, ``save(epoch, step)`` after every epoch and optimizer update."""

    def __init__(
        self,
        run: CheckpointedRun,
        models: CheckpointedModels,
        optimization: OptimizerAndScheduler,
        progress: TrainingProgress,
        augment: Any,
        num_classes: int,
        in_chans: int,
    ):
        self.run, self.cfg, self.accelerator = run, run.cfg, run.accelerator
        self.models, self.optimization, self.progress, self.augment = models, optimization, progress, augment
        self.num_classes, self.in_chans = num_classes, in_chans
        self.folder = CheckpointDir(run.output, self.cfg.keep_checkpoints)

    def parts(self) -> dict[str, Stateful]:
        """The named parts a resume point holds (engine.checkpointing.state_parts); the weights are files beside
        them."""
        exact = {key: getattr(self.cfg, key) for key in exact_options(RESUME_PART_TYPES)}
        parts: dict[str, Stateful] = {
            "identity": RunIdentity(self.cfg.model, exact, self.run.sharded),
            "progress": self.progress,
            "optimizer": OptimizerState(self.optimization, self.run.sharded),
            "scheduler": SchedulerState(self.optimization, self.progress),
            "rng": RandomStreams(self.run, self.progress),
        }
        if self.augment is not None:  # the device half of the input pipeline
            parts["augment"] = AugmentStreams(self.run, self.progress, self.augment)
        if self.accelerator.scaler is not None:  # fp16: torch's GradScaler is a part as it is
            parts["scaler"] = self.accelerator.scaler
        return parts

    def points(self) -> list[Path]:
        """The run's resume points by name, newest first."""
        return self.folder.points()

    # ----------------------------------------------------------------------------------------- load
    def load(self) -> Path | None:
        """The resume point's state loaded into the parts: weights and optimizer state from every rank's shards
        under FSDP (on any number of ranks), the EMA's weights, then each part of training_state.pt. Returns the
        point, or None for a run that does not resume (its model's weights are loaded at set-up)."""
        point, state = self.run.resume_point, self.run.resume_state
        if not state:
            return None
        if self.run.sharded:
            load_sharded(point, self.models.model, self.optimization.optimizer.optimizer)
        if self.models.ema is not None and (point / EMA_FILE).is_file():
            load_weights(self.models.ema.module, point / EMA_FILE)
        restore(self.parts(), state)
        return point

    # ----------------------------------------------------------------------------------------- save
    def save(
        self,
        epoch: int,
        step: int = 0,
        *,
        is_best: bool = False,
        loss_sum: torch.Tensor | None = None,
        force: bool = False,
    ) -> Path | None:
        """After ``epoch`` epochs (``step`` 0): the resume point, and the --save-epochs snapshot when ``epoch`` is
        one. ``step`` updates into the next epoch: a resume point (with every rank's loss accumulator
        ``loss_sum``) every --checkpoint-interval optimizer updates, or when ``force`` (a preemption). Every
        rank calls it (it gathers); returns the point's directory on the main process, else None."""
        interval = self.cfg.checkpoint_interval
        if step and not (force or (interval and self.progress.num_updates % interval == 0)):
            return None
        point = self._save_point(epoch, is_best, step, loss_sum)
        if not step and epoch in self.cfg.save_epochs:
            self.save_snapshot(epoch)
        return point

    def save_initial(self) -> None:
        """The --save-epochs 0 snapshot: a fresh run's initial weights."""
        if 0 in self.cfg.save_epochs:
            self.save_snapshot(0)

    def save_snapshot(self, epoch: int) -> None:
        weights = self.accelerator.get_state_dict(self.models.model)
        if self.accelerator.is_main_process:
            self.folder.save_snapshot(epoch, weights, self.metadata(epoch))
        self.accelerator.wait_for_everyone()

    def metadata(self, epoch: int) -> dict[str, str]:
        """What a weights file says of itself: enough to rebuild its model (engine.checkpointing.run_dir)."""
        return {
            "model": self.cfg.model,
            "epoch": str(epoch),
            "reparametrized": str(self.progress.reparametrized),
            "num_classes": str(self.num_classes),
            "in_chans": str(self.in_chans),
            "reparametrization": self.cfg.reparametrize or "",
            "output_scale": str(self.cfg.output_scale or ""),
        }

    def _save_point(self, epoch: int, is_best: bool, step: int, loss_sum: torch.Tensor | None) -> Path | None:
        acc, progress = self.accelerator, self.progress
        weights = acc.get_state_dict(self.models.model)  # collective under FSDP: every rank calls it
        progress.epoch, progress.step = epoch, step
        progress.loss_sums = gather_object([loss_sum.item() if loss_sum is not None else 0.0])
        if not (epoch == 0 and step):  # the initial diagnostics are logged with the first epoch
            progress.initial_diagnostics = {}
        state = resume_state(self.parts())  # the RNG part gathers every rank's states
        staging = self.folder.stage(epoch, step) if acc.is_main_process else None
        if self.run.sharded:  # every rank writes its shards into the staged directory (on a shared file system)
            self._save_shards(broadcast_object_list([staging])[0])
        point = None
        if acc.is_main_process:
            ema = self.models.ema.module.state_dict() if self.models.ema is not None else None
            point = self.folder.save(epoch, weights, state, ema, self.metadata(epoch), is_best, step)
        acc.wait_for_everyone()
        return point

    def _save_shards(self, staging: Path) -> None:
        try:
            save_sharded(staging, self.models.model, self.optimization.optimizer.optimizer)
        except (OSError, RuntimeError, CheckpointException) as e:  # DCP reports every rank's failure
            if self.accelerator.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)
            raise StorageError(
                f"writing the shards of {staging} failed ({storage_reason(e, self.run.output)})"
            ) from None
        self.accelerator.wait_for_everyone()
