"""timm's training checkpoint (``last.pth.tar``, ...) continued by a run of this engine: ``--resume FILE.pth.tar``
read as timm's train.py resumes it, one loader of its own beside this engine's resume points (engine.checkpoint.resume)."""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import set_seed

from convbias.base.errors import ConfigError
from convbias.base.weights import load_checked, rebuild_hint

from ..config.options import Config
from ..optim.factory import main_lr
from ..rundir.timm_files import IMPLEMENTATION_FLAGS, TimmCheckpoint, read_timm_checkpoint
from .parts import Stateful


def _describe_groups(groups: list[dict[str, Any]]) -> str:
    return ", ".join(f"{len(g['params'])} (weight decay {g.get('weight_decay', 0):g})" for g in groups)


def _group_key(group: dict[str, Any]) -> tuple[int, bool]:
    """What pairs a saved parameter group with one of this run's: its size and whether it decays."""
    return len(group["params"]), group.get("weight_decay", 0) == 0


def aligned_optimizer_state(
    saved: dict[str, Any], optimizer: torch.optim.Optimizer, source: str, option: str
) -> dict[str, Any]:
    """``saved`` (timm's ``optimizer.state_dict()``) with its parameter groups in ``optimizer``'s order, ready
    for ``optimizer.load_state_dict``. Groups are paired by their number of parameters and whether they decay
    (timm lists the group without weight decay first, this engine in the order of the model's parameters); the
    parameters inside a group are in the model's order in both. The keys this engine adds to a group (its
    lr pattern, parameter names) are kept. ConfigError (one line) naming what differs: the number or sizes of
    the groups, the optimizer (its hyper-parameter names), a state tensor's shape."""
    saved_groups, groups = saved["param_groups"], optimizer.param_groups
    sizes = f"the file's parameter groups: {_describe_groups(saved_groups)}; this run's: {_describe_groups(groups)}"
    if len(saved_groups) != len(groups):
        raise ConfigError(
            f"{option} {source}: its optimizer state does not fit this run's optimizer ({sizes}); give the options "
            f"timm's run had (--weight-decay, --layer-decay, --opt), or start from its weights with "
            f"--initial-checkpoint {source}"
        )
    unused, order = list(range(len(saved_groups))), []
    for group in groups:
        key = _group_key(group)
        match = next((i for i in unused if _group_key(saved_groups[i]) == key), None)
        if match is None:
            raise ConfigError(
                f"{option} {source}: its optimizer state does not fit this run's optimizer ({sizes}); give the "
                f"options timm's run had, or start from its weights with --initial-checkpoint {source}"
            )
        unused.remove(match)
        order.append(match)
    missing = sorted(set(optimizer.defaults) - set(saved_groups[0]) - IMPLEMENTATION_FLAGS)
    if missing:
        raise ConfigError(
            f"{option} {source}: its optimizer state was written by another optimizer than this run's "
            f"{type(optimizer).__name__} (its groups lack {', '.join(missing)}); give timm's run's --opt, or start "
            f"from its weights with --initial-checkpoint {source}"
        )
    state = saved.get("state", {})
    for group, index in zip(groups, order):
        for param, saved_id in zip(group["params"], saved_groups[index]["params"]):
            for name, value in state.get(saved_id, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() == param.dim() > 0 and value.shape != param.shape:
                    raise ConfigError(
                        f"{option} {source}: its optimizer state {name} {tuple(value.shape)} does not fit a parameter "
                        f"{tuple(param.shape)} of this run's model; start from its weights with "
                        f"--initial-checkpoint {source}"
                    )
    kept = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    return {
        "state": state,
        "param_groups": [{**extra, **saved_groups[i]} for extra, i in zip(kept, order)],
    }


def read_timm_resume(cfg: Config, epochs: int) -> TimmCheckpoint:
    """--resume of timm's training checkpoint: read safely, of --model (its args name the model it trained),
    with epochs left to train."""
    checkpoint = read_timm_checkpoint(cfg.resume)
    model = checkpoint.args.get("model")
    if model is not None and model != cfg.model:
        raise ConfigError(f"--resume {cfg.resume} is timm's checkpoint of {model}, not of --model {cfg.model}")
    if checkpoint.resume_epoch >= epochs:
        raise ConfigError(
            f"--resume {cfg.resume} is timm's checkpoint after {checkpoint.resume_epoch} epochs, and this run has "
            f"{epochs}: nothing is left to train; give a larger --epochs"
        )
    return checkpoint


def load_timm_checkpoint(timm: TimmCheckpoint, cfg: Config, parts: dict[str, Stateful], models: Any) -> str:
    """timm's training checkpoint, read as timm's train.py resumes: the model's weights, the optimizer's state
    (with its groups' lr, initial_lr and weight decay, as torch's load_state_dict restores them), the EMA's
    weights (state_dict_ema; the model's when the file has none), the loss scaler's state and the epoch:
    training continues with the epoch after the file's, its schedule created again over the loaded groups
    (timm's train.py creates it after loading) and stepped to that epoch. The file holds no random streams:
    every rank's are drawn as a fresh run's. Returns the sentence that says so."""
    acc, progress, schedule = models.accelerator, parts["progress"], parts["scheduler"]
    optimizer = schedule.optimization.optimizer
    model = acc.unwrap_model(models.model)
    with rebuild_hint(timm.path):
        load_checked(model, timm.state_dict, str(timm.path))
    loaded = []
    if timm.optimizer is not None:
        optimizer.load_state_dict(aligned_optimizer_state(timm.optimizer, optimizer, str(timm.path), "--resume"))
        loaded.append("optimizer state")
    if models.ema is not None:
        if timm.ema_state_dict is not None:
            load_checked(models.ema.module, timm.ema_state_dict, f"{timm.path} (state_dict_ema)")
            loaded.append("EMA")
        else:
            models.ema.set(model)
    if acc.scaler is not None and timm.scaler is not None:
        acc.scaler.load_state_dict(timm.scaler)
        loaded.append("loss scaler")
    progress.epoch, progress.num_updates = timm.resume_epoch, timm.resume_epoch * schedule.updates_per_epoch
    schedule.recreate()
    set_seed(cfg.seed + acc.process_index)
    groups = optimizer.param_groups
    initial = {g.get("initial_lr") for g in groups if g.get("lr_pattern") is None}
    follows = ""
    if initial and initial != {schedule.lr} and None not in initial:
        follows = (
            f"; its schedule starts from the file's lr ({', '.join(f'{lr:.3g}' for lr in sorted(initial))}), "
            f"not {schedule.lr:.3g}, as timm's train.py resumes"
        )
    return (
        f"resumed from timm's {timm.path} (its epoch {timm.epoch}): {progress.epoch} epochs done, "
        f"weights{''.join(', ' + name for name in loaded)} loaded; lr {main_lr(groups):.6g} at epoch "
        f"{progress.epoch + 1}{follows}"
    )
