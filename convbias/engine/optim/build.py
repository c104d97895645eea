"""What turns a run's loss into an update, built whole: optimizer, schedule, mixup/cutmix and the training loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate.optimizer import AcceleratedOptimizer
from timm.data import Mixup
from timm.scheduler.scheduler import Scheduler
from torch import nn

from ..config.derived import RunValues
from ..config.options import Config
from .factory import create_mixup, create_scheduler, create_train_loss


@dataclass
class Optimization:
    """What turns a loss into an update: optimizer, schedule, mixup/cutmix and the training loss. Attributes, since
    a reparametrization replaces the optimizer and the schedule mid-run."""

    optimizer: AcceleratedOptimizer  # as accelerate prepared it with the model
    scheduler: Scheduler  # timm's, stepped per update
    mixup: Mixup | None
    train_loss: nn.Module


def build_optimization(
    cfg: Config,
    optimizer: AcceleratedOptimizer,
    values: RunValues,
    updates_per_epoch: int,
    head_classes: int,
    device: torch.device,
) -> Optimization:
    """The Optimization around a prepared ``optimizer``: the schedule over ``values``' epochs, mixup's targets of
    the head's size (``head_classes``) and the loss, as timm's train.py builds them."""
    scheduler = create_scheduler(cfg, optimizer, values.schedule_epochs, values.warmup_epochs, updates_per_epoch)
    mixup = create_mixup(cfg, head_classes)
    return Optimization(optimizer, scheduler, mixup, create_train_loss(cfg, mixup).to(device))
