"""What the training loop saves and loads: one ``CheckpointManager`` per run.

The trainer constructs it with the run's stateful parts and calls ``load()`` once: what the run resumes
(engine.checkpointing.resume found it) restored into every part, the weights included, or a timm training
checkpoint through its adapter (``_load_timm``); then ``save(epoch, step)`` after every epoch and every
optimizer update. The manager owns the rest: the parts a resume point holds (``RESUME_PART_TYPES``, ``parts()``),
when a mid-epoch point is due (--checkpoint-interval, a preemption), the weights' metadata, every rank's FSDP
shards, and, through ``CheckpointDir`` (engine.checkpointing.points), staging, manifests, the ``last`` /
``best`` links, rotation and the --save-epochs snapshots.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from torch.distributed.checkpoint.api import CheckpointException

from convbias.base.errors import StorageError
from convbias.base.run_layout import EMA_FILE, WEIGHTS_FILE
from convbias.base.storage import storage_reason
from convbias.base.weights import load_checked, load_weights, rebuild_hint

from ..optim import factory as optim
from .points import CheckpointDir
from .resume import Resume, ResumePoint
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
from .timm_checkpoint import TimmCheckpoint, aligned_optimizer_state

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
    """What the manager reads of the run (engine.loop.start.RunStart is one)."""

    output: Path
    sharded: bool  # FSDP: weights and optimizer state are every rank's shards
    resume: Resume | None  # engine.checkpointing.resume.find_resume's answer
    values: Any  # engine.config.derived.RunValues: a timm checkpoint's schedule is created again from them


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
        updates_per_epoch: int,
    ):
        self.run, self.cfg, self.accelerator = run, run.cfg, run.accelerator
        self.models, self.optimization, self.progress, self.augment = models, optimization, progress, augment
        self.num_classes, self.in_chans, self.updates_per_epoch = num_classes, in_chans, updates_per_epoch
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
    def load(self) -> str | None:
        """What the run resumes, restored into every part in this one call; returns the sentence that says so, or
        None for a run that starts fresh (its model's weights are its set-up's)."""
        resume = self.run.resume
        if isinstance(resume, TimmCheckpoint):
            return self._load_timm(resume)
        if isinstance(resume, ResumePoint):
            return self._load_point(resume)
        return None

    def _load_point(self, point: ResumePoint) -> str:
        """This engine's point: the weights (every rank's shards under FSDP, on any number of ranks), the EMA's
        (the model's when the point has none), then each part of its training state."""
        model = self.accelerator.unwrap_model(self.models.model)
        if self.run.sharded:
            load_sharded(point.path, self.models.model, self.optimization.optimizer.optimizer)
        else:
            load_weights(model, point.path / WEIGHTS_FILE)
        if self.models.ema is not None:
            if (point.path / EMA_FILE).is_file():
                load_weights(self.models.ema.module, point.path / EMA_FILE)
            elif not self.run.sharded:
                self.models.ema.set(model)
        restore(self.parts(), point.state)
        progress = self.progress
        within = f" and {progress.step} steps of epoch {progress.epoch + 1}" if progress.step else ""
        return f"resumed from {point} after epoch {progress.epoch}{within}"

    def _load_timm(self, timm: TimmCheckpoint) -> str:
        """timm's training checkpoint, read as timm's train.py resumes: the model's weights, the optimizer's state
        (with its groups' lr, initial_lr and weight decay, as torch's load_state_dict restores them), the EMA's
        weights (state_dict_ema; the model's when the file has none), the loss scaler's state and the epoch:
        training continues with the epoch after the file's, its schedule created again over the loaded groups
        (timm's train.py creates it after loading) and stepped to that epoch. The file holds no random streams:
        every rank's are drawn as a fresh run's."""
        cfg, acc, progress, optimization = self.cfg, self.accelerator, self.progress, self.optimization
        model = acc.unwrap_model(self.models.model)
        with rebuild_hint(timm.path):
            load_checked(model, timm.state_dict, str(timm.path))
        loaded = []
        if timm.optimizer is not None:
            optimizer = optimization.optimizer
            optimizer.load_state_dict(aligned_optimizer_state(timm.optimizer, optimizer, str(timm.path), "--resume"))
            loaded.append("optimizer state")
        if self.models.ema is not None:
            if timm.ema_state_dict is not None:
                load_checked(self.models.ema.module, timm.ema_state_dict, f"{timm.path} (state_dict_ema)")
                loaded.append("EMA")
            else:
                self.models.ema.set(model)
        if acc.scaler is not None and timm.scaler is not None:
            acc.scaler.load_state_dict(timm.scaler)
            loaded.append("loss scaler")
        progress.epoch, progress.num_updates = timm.resume_epoch, timm.resume_epoch * self.updates_per_epoch
        values = self.run.values
        optimization.scheduler = optim.create_scheduler(
            cfg, optimization.optimizer, values.schedule_epochs, values.warmup_epochs, self.updates_per_epoch
        )
        optim.set_scheduled_lr(optimization.scheduler, progress.num_updates, progress.epoch)
        set_seed(cfg.seed + acc.process_index)
        groups = optimization.optimizer.param_groups
        initial = {g.get("initial_lr") for g in groups if g.get("lr_pattern") is None}
        follows = ""
        if initial and initial != {values.lr} and None not in initial:
            follows = (
                f"; its schedule starts from the file's lr ({', '.join(f'{lr:.3g}' for lr in sorted(initial))}), "
                f"not {values.lr:.3g}, as timm's train.py resumes"
            )
        return (
            f"resumed from timm's {timm.path} (its epoch {timm.epoch}): {progress.epoch} epochs done, "
            f"weights{''.join(', ' + name for name in loaded)} loaded; lr {optim.main_lr(groups):.6g} at epoch "
            f"{progress.epoch + 1}{follows}"
        )

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
