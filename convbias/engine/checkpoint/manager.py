"""What the training loop saves and loads: one ``CheckpointManager`` per run.

The trainer constructs it with the run's folder, its options, the stateful parts a resume point holds
(``engine.checkpoint.parts.resume_parts``, as torchtitan's checkpointer takes its ``states``) and its models,
and ``fit()`` begins with one ``load(resume)``: what the run resumes restored into every part, the weights
included, by the loader of its format (this engine's points: ``resume.load_point``; timm's training
checkpoint: ``timm_resume.load_timm_checkpoint``). Then ``save(epoch, step)`` after every epoch and every
optimizer update. The manager owns the rest: when a mid-epoch point is due (--checkpoint-interval, a
preemption), the weights' metadata, every rank's FSDP shards, and, through ``CheckpointDir``
(engine.checkpoint.points), staging, manifests, the ``last`` / ``best`` links, rotation and the --save-epochs
snapshots.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from torch.distributed.checkpoint.api import CheckpointException

from convbias.base.errors import StorageError
from convbias.base.storage import storage_reason

from ..config.options import Config
from ..rundir.timm_files import TimmCheckpoint
from .parts import Stateful, resume_state
from .points import CheckpointDir
from .resume import Resume, load_point
from .shards import save_sharded
from .timm_resume import load_timm_checkpoint


class CheckpointedModels(Protocol):
    """The run's models (engine.model.build.Models is one): attributes, since a reparametrization replaces them."""

    accelerator: Accelerator
    model: torch.nn.Module  # as accelerate prepared it
    ema: Any  # timm's ModelEmaV3, or None
    num_classes: int  # the classifier's outputs
    in_chans: int  # the images' channels


class CheckpointManager:
    """A run's resume points: ``load(resume)`` once, ``save(epoch, step)`` after every epoch and optimizer update."""

    def __init__(self, folder: CheckpointDir, cfg: Config, parts: dict[str, Stateful], models: CheckpointedModels):
        self.folder, self.cfg, self.parts, self.models = folder, cfg, parts, models
        self.accelerator, self.progress = models.accelerator, parts["progress"]

    def points(self) -> list[Path]:
        """The run's resume points by name, newest first."""
        return self.folder.points()

    def load(self, resume: Resume | None) -> str | None:
        """What the run resumes, restored into every part in this one call; returns the sentence that says so, or
        None for a run that starts fresh (its model's weights are its set-up's)."""
        if resume is None:
            return None
        if isinstance(resume, TimmCheckpoint):
            return load_timm_checkpoint(resume, self.cfg, self.parts, self.models)
        return load_point(resume, self.parts, self.models)

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
        """What a weights file says of itself: enough to rebuild its model (engine.rundir.reader)."""
        return {
            "model": self.cfg.model,
            "epoch": str(epoch),
            "reparametrized": str(self.progress.reparametrized),
            "num_classes": str(self.models.num_classes),
            "in_chans": str(self.models.in_chans),
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
        state = resume_state(self.parts)  # the RNG part gathers every rank's states
        staging = self.folder.stage(epoch, step) if acc.is_main_process else None
        if acc.is_fsdp2:  # every rank writes its shards into the staged directory (on a shared file system)
            self._save_shards(broadcast_object_list([staging])[0])
        point = None
        if acc.is_main_process:
            ema = self.models.ema.module.state_dict() if self.models.ema is not None else None
            point = self.folder.save(epoch, weights, state, ema, self.metadata(epoch), is_best, step)
        acc.wait_for_everyone()
        return point

    def _save_shards(self, staging: Path) -> None:
        try:
            save_sharded(staging, self.models.model, self.parts["optimizer"].optimization.optimizer.optimizer)
        except (OSError, RuntimeError, CheckpointException) as e:  # DCP reports every rank's failure
            if self.accelerator.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)
            raise StorageError(
                f"writing the shards of {staging} failed ({storage_reason(e, self.folder.root.parent)})"
            ) from None
        self.accelerator.wait_for_everyone()
