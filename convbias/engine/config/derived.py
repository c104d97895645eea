"""The values a run derives from its options: epochs after ``--scale-epochs``, the lr scaled to the global batch
and the rule that gave it. ``RunValues`` holds them all, computed once when the run is set up (engine.loop.setup),
where the number of processes is known; the epochs the run trains are timm's count (engine.optim), passed in."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .options import Config


def effective_epochs(cfg: Config) -> tuple[int, int]:
    """(epochs, warmup epochs) after ``--scale-epochs``: both x 1/train_fraction, rounded up."""
    if not cfg.scale_epochs:
        return cfg.epochs, cfg.warmup_epochs
    scale = 1.0 / cfg.train_fraction
    return math.ceil(cfg.epochs * scale - 1e-9), math.ceil(cfg.warmup_epochs * scale - 1e-9)


def lr_scaling(cfg: Config) -> str:
    """linear or sqrt: how --lr-base follows the global batch; timm's '' is sqrt for Adam-family and LAMB
    optimizers, as its train.py picks."""
    if cfg.lr_base_scale:
        return cfg.lr_base_scale
    return "sqrt" if any(name in cfg.opt.lower() for name in ("ada", "lamb")) else "linear"


def scaled_lr(cfg: Config, global_batch: int) -> tuple[float, str]:
    """The run's lr and the rule that gave it: --lr, else --lr-base scaled to the global batch."""
    if cfg.lr is not None:
        return cfg.lr, "--lr"
    ratio = f"{global_batch} / --lr-base-size {cfg.lr_base_size}"
    if lr_scaling(cfg) == "sqrt":
        return cfg.lr_base * (global_batch / cfg.lr_base_size) ** 0.5, f"--lr-base {cfg.lr_base:g} x sqrt({ratio})"
    return cfg.lr_base * global_batch / cfg.lr_base_size, f"--lr-base {cfg.lr_base:g} x {ratio}"


@dataclass(frozen=True)
class RunValues:
    """What a run derives from its options and its number of processes."""

    schedule_epochs: int  # --epochs after --scale-epochs: the length the lr schedule is given
    warmup_epochs: int  # --warmup-epochs after --scale-epochs
    epochs: int  # the epochs the run trains: the schedule's, and a cooldown, further lr cycles, a warmup prefix
    global_batch: int  # --batch-size x processes x --grad-accum-steps
    lr: float
    lr_rule: str  # how the lr was given or scaled (the start-up block and warnings show it)

    @classmethod
    def derive(cls, cfg: Config, num_processes: int, trained_epochs: int) -> RunValues:
        """The values of ``cfg`` run on ``num_processes``; ``trained_epochs``: timm's count for its schedule."""
        schedule_epochs, warmup_epochs = effective_epochs(cfg)
        global_batch = cfg.batch_size * num_processes * cfg.grad_accum_steps
        lr, rule = scaled_lr(cfg, global_batch)
        return cls(schedule_epochs, warmup_epochs, trained_epochs, global_batch, lr, rule)


def ema_is_the_metric(options: Any) -> bool:
    """Whether the EMA's evaluation is the epoch's metric (``options``: a Config or its dict): with --model-ema, as
    timm's train.py takes it (unless --no-model-ema-metric, timm's --model-ema-force-cpu)."""
    values = options if isinstance(options, dict) else vars(options)
    return bool(values.get("model_ema")) and bool(values.get("model_ema_metric", True))
