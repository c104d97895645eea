"""The training recipe's pieces, built from timm: parameter groups, optimizer, schedule, losses, EMA.

Defaults follow DeiT: AdamW, lr 5e-4 x global batch / 512, weight decay 0.05 on weight matrices only
(timm's rule: no decay on 1-D parameters (norms, GPSA gates), biases, and the names a model lists in
``no_weight_decay()`` (position embeddings, class/distillation tokens)), warmup then cosine to 1e-5, mixup/cutmix with soft-target cross-entropy, label smoothing.

The lr schedule is stepped per optimizer update (timm ``step_update``), not per epoch: warmup and decay
are smooth even for runs of a few epochs, and a resumed run lands on exactly the same lr because the
schedule is a pure function of the update count.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2, param_groups_weight_decay
from timm.scheduler import create_scheduler_v2
from torch import nn

from ..errors import ConfigError
from .config import Config


def param_groups(
    model: nn.Module, weight_decay: float, group_lr: dict[str, float], require_all_patterns: bool = True
) -> list[dict[str, Any]]:
    """Parameter groups keyed by (weight decay on/off, lr override).

    ``group_lr`` maps a regex to an absolute lr (``{'gating_param': 0.1}``); the first matching regex
    wins. The schedule (warmup, cosine) applies to every group from its own base lr. Each group keeps
    ``param_names`` so the optimizer state can be carried over when the model is reparametrized.
    A regex that matches no parameter is an error unless ``require_all_patterns`` is False (a CNN
    before ``--reparametrize-at-epoch`` has no gating parameters yet).
    """
    model_no_decay = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    # timm's rule (1-D parameters, biases and the model's no_weight_decay() names), from timm itself
    timm_groups = param_groups_weight_decay(model, weight_decay or 1.0, no_weight_decay_list=model_no_decay)
    no_decay = {id(p) for group in timm_groups if group["weight_decay"] == 0 for p in group["params"]}
    groups: dict[tuple, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        pattern = next((p for p in group_lr if re.search(p, name)), None)
        decay = 0.0 if id(param) in no_decay else weight_decay
        group = groups.setdefault(
            (decay, pattern), {"params": [], "param_names": [], "weight_decay": decay, "lr_pattern": pattern}
        )
        if pattern is not None:
            group["lr"] = float(group_lr[pattern])
        group["params"].append(param)
        group["param_names"].append(name)
    unused = [p for p in group_lr if not any(key[1] == p for key in groups)]
    if unused and require_all_patterns:
        raise ConfigError(f"--param-group-lr: no parameter name matches {', '.join(unused)}")
    return list(groups.values())


def create_optimizer(
    cfg: Config, model: nn.Module, lr: float, require_all_patterns: bool = True
) -> torch.optim.Optimizer:
    """timm's optimizer factory on our parameter groups."""
    kwargs = {"eps": cfg.opt_eps} if cfg.opt.lower().startswith(("adam", "nadam", "radam")) else {}
    return create_optimizer_v2(
        model,
        opt=cfg.opt,
        lr=lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.momentum,
        param_group_fn=lambda m: param_groups(m, cfg.weight_decay, cfg.param_group_lr, require_all_patterns),
        **kwargs,
    )


def rebuild_optimizer(cfg: Config, model: nn.Module, lr: float, old: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A new optimizer for a changed model that keeps the state of every surviving parameter.

    A parameter survives when the new model has a parameter of the same name and shape; its moments
    (and step count) move over. New parameters start from an empty state.
    """
    old_state = {}
    for group in old.param_groups:
        for name, param in zip(group["param_names"], group["params"]):
            if param in old.state:
                old_state[name] = (param.shape, old.state[param])
    new = create_optimizer(cfg, model, lr)
    for group in new.param_groups:
        for name, param in zip(group["param_names"], group["params"]):
            if name in old_state and old_state[name][0] == param.shape:
                new.state[param] = {
                    k: v.to(param.device) if torch.is_tensor(v) and v.ndim else v for k, v in old_state[name][1].items()
                }
    return new


def create_scheduler(
    cfg: Config, optimizer: torch.optim.Optimizer, epochs: int, warmup_epochs: int, updates_per_epoch: int
):
    """timm scheduler stepped per update. 'constant' is a step schedule whose decay factor is 1."""
    sched, decay_rate = ("step", 1.0) if cfg.sched == "constant" else (cfg.sched, cfg.decay_rate)
    scheduler, _ = create_scheduler_v2(
        optimizer,
        sched=sched,
        num_epochs=epochs,
        decay_epochs=cfg.decay_epochs,
        decay_rate=decay_rate,
        min_lr=cfg.min_lr,
        warmup_lr=cfg.warmup_lr,
        warmup_epochs=warmup_epochs,
        step_on_epochs=False,
        updates_per_epoch=updates_per_epoch,
    )
    return scheduler


def create_mixup(cfg: Config, num_classes: int) -> Mixup | None:
    if cfg.mixup <= 0 and cfg.cutmix <= 0:
        return None
    return Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.smoothing, num_classes=num_classes)


def create_train_loss(cfg: Config, mixup: Mixup | None) -> nn.Module:
    """Soft-target CE with mixup/cutmix (smoothing is folded into the soft targets), else smoothed CE."""
    if mixup is not None:
        return SoftTargetCrossEntropy()
    if cfg.smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=cfg.smoothing)
    return nn.CrossEntropyLoss()


class HardDistillationLoss(nn.Module):
    """DeiT's hard distillation: mean of the base loss on the class head and CE against the teacher's argmax.

    A model with a distillation token returns ``(class_logits, distill_logits)`` in training (timm's
    ``set_distilled_training(True)``); the second term uses the distillation head. A model without one
    (ConViT, DeiT without token) returns a single tensor, and both terms use it: the class head learns
    from the labels and from the teacher's hard labels, weighted 1/2 each.
    """

    def __init__(self, base_loss: nn.Module, teacher: nn.Module):
        super().__init__()
        self.base_loss = base_loss
        self.teacher = teacher.eval().requires_grad_(False)

    def forward(self, images: torch.Tensor, outputs, targets: torch.Tensor) -> torch.Tensor:
        class_logits, distill_logits = outputs if isinstance(outputs, (tuple, list)) else (outputs, outputs)
        with torch.no_grad():
            teacher_labels = self.teacher(images).argmax(dim=-1)
        return 0.5 * self.base_loss(class_logits, targets) + 0.5 * F.cross_entropy(distill_logits, teacher_labels)
