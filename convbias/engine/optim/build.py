"""What turns a run's loss into an update, built whole: optimizer, schedule, mixup/cutmix and the training loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

from ..config.derived import RunValues
from ..config.options import Config
from .factory import create_mixup, create_optimizer, create_scheduler, create_train_loss


@dataclass
class Optimization:
    """What turns a loss into an update: optimizer, schedule, mixup/cutmix and the training loss."""

    optimizer: Any  # accelerate's AcceleratedOptimizer
    scheduler: Any  # a timm scheduler, stepped per update
    mixup: Any
    train_loss: Any


def build_optimization(
    cfg: Config,
    acc: Accelerator,
    model: torch.nn.Module,
    values: RunValues,
    updates_per_epoch: int,
    head_classes: int,
    before_reparametrization: bool,
) -> tuple[torch.nn.Module, Optimization]:
    """(prepared model, Optimization): the model and its optimizer go through accelerate.prepare together; the
    schedule over ``values``' epochs, mixup's targets of the head's size (``head_classes``), as timm's."""
    optimizer = create_optimizer(cfg, model, values.lr, require_all_patterns=not before_reparametrization)
    if acc.is_fsdp2:  # every rank has built the whole model; accelerate's rank-0 loading (on by default)
        acc.state.fsdp_plugin.cpu_ram_efficient_loading = False  # serves transformers models only
    model, optimizer = acc.prepare(model, optimizer)
    scheduler = create_scheduler(cfg, optimizer, values.schedule_epochs, values.warmup_epochs, updates_per_epoch)
    mixup = create_mixup(cfg, head_classes)
    return model, Optimization(optimizer, scheduler, mixup, create_train_loss(cfg, mixup).to(acc.device))
