"""Optimization, built from timm: parameter groups, optimizer, schedule, mixup/cutmix, losses,
EMA, gradient clipping.

The defaults are timm's train.py's (the DeiT recipe is configs/recipes/deit.yaml). Weight decay follows timm's
rule: none on 1-D parameters (norms, GPSA gates), biases and the names a model lists in ``no_weight_decay()``
(position embeddings, class/distillation tokens). The lr schedule is stepped per epoch, as timm's train.py steps
it, or per optimizer update with ``--sched-on-updates`` (timm ``step_update``); the plateau schedule always steps
per evaluation. Either way a resumed run lands on exactly the same lr.
"""

from __future__ import annotations

import inspect
import re
import warnings
from functools import cache
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import (
    create_optimizer_v2,
    get_optimizer_info,
    optimizer_kwargs,
    param_groups_layer_decay,
    param_groups_weight_decay,
)
from timm.scheduler import PlateauLRScheduler, create_scheduler_v2, scheduler_kwargs
from timm.utils import dispatch_clip_grad
from torch import nn

from convbias.base.errors import ConfigError

from ..config.derived import effective_epochs
from ..config.options import Config

if TYPE_CHECKING:
    from accelerate import Accelerator


def param_groups(
    model: nn.Module,
    weight_decay: float,
    group_lr: dict[str, float],
    require_all_patterns: bool = True,
    layer_decay: float | None = None,
    layer_decay_min_scale: float = 0.0,
    layer_decay_no_opt_scale: float | None = None,
) -> list[dict[str, Any]]:
    """Parameter groups keyed by (weight decay on/off, lr override, layer-decay scale).

    ``group_lr`` maps a regex to an absolute lr (``{'gating_param': 0.1}``); the first matching regex
    wins. The schedule (warmup, cosine) applies to every group from its own base lr, times the group's
    ``lr_scale`` under ``layer_decay`` (timm's schedulers apply it; at least ``layer_decay_min_scale``, and the
    layers scaled below ``layer_decay_no_opt_scale`` are frozen, as timm freezes them). Each group keeps
    ``param_names`` so the optimizer state can be carried over when the model is reparametrized.
    A regex that matches no parameter is an error unless ``require_all_patterns`` is False (a CNN
    before ``--reparametrize-at-epoch`` has no gating parameters yet).
    """
    model_no_decay = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    # timm's rule (1-D parameters, biases and the model's no_weight_decay() names), from timm itself
    timm_groups = param_groups_weight_decay(model, weight_decay or 1.0, no_weight_decay_list=model_no_decay)
    no_decay = {id(p) for group in timm_groups if group["weight_decay"] == 0 for p in group["params"]}
    scales = {}
    if layer_decay is not None:  # before the loop below: it freezes the layers under layer_decay_no_opt_scale
        scales = layer_scales(model, layer_decay, layer_decay_min_scale, layer_decay_no_opt_scale)
    groups: dict[tuple, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        pattern = next((p for p in group_lr if re.search(p, name)), None)
        decay = 0.0 if id(param) in no_decay else weight_decay
        scale = scales.get(id(param))
        group = groups.setdefault(
            (decay, pattern, scale), {"params": [], "param_names": [], "weight_decay": decay, "lr_pattern": pattern}
        )
        if pattern is not None:
            group["lr"] = float(group_lr[pattern])
        if scale is not None:
            group["lr_scale"] = scale
        group["params"].append(param)
        group["param_names"].append(name)
    unused = [p for p in group_lr if not any(key[1] == p for key in groups)]
    if unused and require_all_patterns:
        raise ConfigError(f"--param-group-lr: no parameter name matches {', '.join(unused)}")
    return list(groups.values())


def layer_scales(
    model: nn.Module, layer_decay: float, min_scale: float = 0.0, no_opt_scale: float | None = None
) -> dict[int, float]:
    """id(parameter) -> its lr scale under ``--layer-decay``, from timm's param_groups_layer_decay over the
    model's group_matcher() (the stem's group first, the classifier's last at scale 1), which also freezes
    (requires_grad False) the parameters scaled below ``no_opt_scale``. A model without a group_matcher() has no
    layer order to follow (timm would guess it from the parameters' order): a ConfigError."""
    layered = getattr(model, "trained_model", model)  # a wrapper names the model it trains (OutputScale: not f_w0)
    if not hasattr(layered, "group_matcher"):
        raise ConfigError(
            f"--layer-decay: {type(layered).__name__} has no group_matcher() to number its layers; run without it"
        )
    groups = param_groups_layer_decay(
        layered, weight_decay=0.0, layer_decay=layer_decay, min_scale=min_scale, no_opt_scale=no_opt_scale
    )
    return {id(param): group["lr_scale"] for group in groups for param in group["params"]}


def optimizer_arguments(cfg: Config, lr: float) -> dict[str, Any]:
    """create_optimizer_v2's arguments as timm's train.py gives them (timm's optimizer_kwargs): opt, lr,
    weight_decay, momentum, eps and betas where set, and --opt-kwargs (layer decay is in the parameter groups)."""
    arguments = SimpleNamespace(
        opt=cfg.opt,
        lr=lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.momentum,
        opt_eps=cfg.opt_eps,
        opt_betas=tuple(cfg.opt_betas) if cfg.opt_betas is not None else None,
        opt_args=dict(cfg.opt_kwargs),
    )
    return optimizer_kwargs(arguments)


def create_optimizer(
    cfg: Config, model: nn.Module, lr: float, require_all_patterns: bool = True
) -> torch.optim.Optimizer:
    """timm's optimizer factory on our parameter groups, with --momentum, --opt-eps, --opt-betas and --opt-kwargs as
    timm's train.py passes them (its optimizer_kwargs; the factory gives each optimizer those it takes); an
    argument the optimizer does not take is a ConfigError."""
    kwargs = optimizer_arguments(cfg, lr)
    if multi_tensor(cfg.opt, kwargs):
        kwargs["foreach"] = True
    groups = param_groups(
        model,
        cfg.weight_decay,
        cfg.param_group_lr,
        require_all_patterns,
        cfg.layer_decay,
        cfg.layer_decay_min_scale,
        cfg.layer_decay_no_opt_scale,
    )
    try:
        return create_optimizer_v2(groups, **kwargs)
    except (TypeError, ValueError) as e:  # the optimizer's own check of its arguments
        if not cfg.opt_kwargs:
            raise
        raise ConfigError(f"--opt {cfg.opt} with --opt-kwargs {cfg.opt_kwargs}: {str(e).splitlines()[0]}") from e


def multi_tensor(opt: str, kwargs: dict[str, Any]) -> bool:
    """Whether to ask for torch's multi-tensor implementation (``foreach=True``: a few ops per update for all
    parameters together): where the optimizer takes a ``foreach`` argument and --opt-kwargs sets neither
    ``foreach`` nor ``fused``. torch takes that implementation by itself on CUDA but loops over the parameters
    on the CPU: asking gives every device the GPU's code path, the same update. ``--opt-kwargs fused=True`` asks
    torch for its fused kernel instead (AdamW, Adam, SGD: one kernel per update and parameter group, rounded
    differently from timm's default)."""
    if "foreach" in kwargs or kwargs.get("fused"):
        return False
    optimizer_class = get_optimizer_info(opt.lower().split("_")[-1]).opt_class
    # a class named by a path is imported on use (bitsandbytes'): its own default
    return isinstance(optimizer_class, type) and "foreach" in inspect.signature(optimizer_class).parameters


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


def clip_gradients(cfg: Config, accelerator: Accelerator, model: nn.Module) -> None:
    """--clip-grad by --clip-mode on the (unscaled) gradients: 'norm' through accelerate (the total norm across
    ranks and shards), 'value' and 'agc' through timm's dispatch_clip_grad. agc leaves out the last two trained
    parameters, the classifier's weight and bias, as timm's train.py does (timm's model_parameters(exclude_head=True);
    frozen ones, such as --output-scale's initial copy, are not counted)."""
    if cfg.clip_mode == "norm":
        accelerator.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        return
    accelerator.unscale_gradients()
    parameters = [p for p in model.parameters() if p.requires_grad]
    dispatch_clip_grad(parameters[:-2] if cfg.clip_mode == "agc" else parameters, cfg.clip_grad, mode=cfg.clip_mode)


def _schedule(cfg: Config, epochs: int, warmup_epochs: int) -> dict[str, Any]:
    """create_scheduler_v2's arguments for a schedule of ``epochs``, through timm's own ``scheduler_kwargs`` (as
    its train.py reads them; the plateau schedule watches --eval-metric, the lr noise is seeded by --seed).
    'constant' is a step schedule whose decay factor is 1. Stepped per epoch here; create_scheduler says when
    it steps per update."""
    arguments = scheduler_kwargs(cfg)
    if cfg.sched == "constant":
        arguments.update(sched="step", decay_rate=1.0)
    return dict(arguments, num_epochs=epochs, warmup_epochs=warmup_epochs, step_on_epochs=True)


def _create_timm_scheduler(optimizer: torch.optim.Optimizer, arguments: dict[str, Any]) -> tuple[Any, int]:
    """timm's create_scheduler_v2. Its plateau scheduler warns that its state is not saved in checkpoints; this
    engine saves it (resume_state.SchedulerState), so the warning would mislead."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="PlateauLRScheduler is deprecated", category=FutureWarning)
        try:
            return create_scheduler_v2(optimizer, **arguments)
        except ValueError as e:  # wsd and rsqrt: a decay phase longer than the schedule
            raise ConfigError(f"--sched {arguments['sched']}: {e} (--decay-epochs, --epochs)") from None


def create_scheduler(
    cfg: Config, optimizer: torch.optim.Optimizer, epochs: int, warmup_epochs: int, updates_per_epoch: int
):
    """timm scheduler over ``epochs`` (--epochs after --scale-epochs): stepped per update, or per epoch under
    --no-sched-on-updates and for the plateau schedule. Under --layer-decay the groups' scales apply from the
    first update on (timm's schedulers apply them at their first step)."""
    per_epoch = not cfg.sched_on_updates or cfg.sched == "plateau"
    arguments = dict(_schedule(cfg, epochs, warmup_epochs), step_on_epochs=per_epoch)
    scheduler, _ = _create_timm_scheduler(optimizer, dict(arguments, updates_per_epoch=updates_per_epoch))
    if cfg.layer_decay is not None:
        set_scheduled_lr(scheduler, num_updates=0, epoch=0)
    return scheduler


def set_scheduled_lr(scheduler: Any, num_updates: int, epoch: int) -> None:
    """The lr the schedule gives after ``num_updates`` updates, within epoch ``epoch`` (0-based), as a run that
    resumes there or rebuilds its optimizer sets it. timm's plateau scheduler is stepped from epoch 1 on, as
    timm's train.py does (its step 0 would set the warmup's initial lr even without a warmup); after its warmup
    the lr is the optimizer's own, which a resume point restores."""
    if not scheduler.t_in_epochs:
        scheduler.step_update(num_updates)
    elif epoch > 0 or not isinstance(scheduler, PlateauLRScheduler):
        scheduler.step(epoch)


def scheduled_epochs(cfg: Config, epochs: int, warmup_epochs: int) -> int:
    """The epochs a run trains for a schedule of ``epochs``: those, --cooldown-epochs, the further cycles of
    --lr-cycle-limit and a --warmup-prefix, as timm's create_scheduler_v2 counts them for train.py (per epoch:
    the count per update is the same, rounded down)."""
    arguments = _schedule(cfg, epochs, warmup_epochs)
    return _count_epochs(tuple((key, tuple(v) if isinstance(v, list) else v) for key, v in arguments.items()))


@cache
def _count_epochs(arguments: tuple[tuple[str, Any], ...]) -> int:
    """timm's count for one schedule, taken once (the checks and the run's set-up both need it)."""
    probe = torch.optim.SGD([torch.zeros(1)], lr=1.0)
    return _create_timm_scheduler(probe, dict(arguments))[1]


def trained_epochs(cfg: Config) -> int:
    """The epochs the run of ``cfg`` trains: ``scheduled_epochs`` of its epochs after --scale-epochs (0 when it
    has none: --eval-only)."""
    return scheduled_epochs(cfg, *effective_epochs(cfg)) if cfg.epochs >= 1 else 0


def create_mixup(cfg: Config, num_classes: int) -> Mixup | None:
    """timm's Mixup, as timm's train.py sets it up: on when --mixup, --cutmix or --cutmix-minmax is."""
    if cfg.mixup <= 0 and cfg.cutmix <= 0 and cfg.cutmix_minmax is None:
        return None
    return Mixup(
        mixup_alpha=cfg.mixup,
        cutmix_alpha=cfg.cutmix,
        cutmix_minmax=cfg.cutmix_minmax,
        prob=cfg.mixup_prob,
        switch_prob=cfg.mixup_switch_prob,
        mode=cfg.mixup_mode,
        label_smoothing=cfg.smoothing,
        num_classes=num_classes,
    )


def create_train_loss(cfg: Config, mixup: Mixup | None) -> nn.Module:
    """The training loss timm's train.py chooses, in its order: with mixup/cutmix, BCE (--bce-loss) or
    soft-target CE on the mixed targets, which carry the smoothing; else with --smoothing, BCE on smoothed one-hot
    targets or smoothed CE; else plain CE, --bce-loss or not. Built with timm's arguments (its BCE's own default
    smoothing stays with mixup: dense targets are taken as they are)."""
    bce = dict(target_threshold=cfg.bce_target_thresh, sum_classes=cfg.bce_sum, pos_weight=cfg.bce_pos_weight)
    if mixup is not None:
        return BinaryCrossEntropy(**bce) if cfg.bce_loss else SoftTargetCrossEntropy()
    if cfg.smoothing:
        if cfg.bce_loss:
            return BinaryCrossEntropy(smoothing=cfg.smoothing, **bce)
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


def main_lr(param_groups: list[dict[str, Any]]) -> float:
    """The lr of the first group without a --param-group-lr override or a --layer-decay scale below 1 (the run's
    main lr)."""
    main = (g["lr"] for g in param_groups if g.get("lr_pattern") is None and g.get("lr_scale", 1.0) == 1.0)
    return next(main, param_groups[0]["lr"])
