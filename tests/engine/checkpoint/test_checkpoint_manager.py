"""CheckpointManager on its own: what save() writes after an epoch and within one, and what load() restores into
fresh parts (a one-layer model, accelerate on the CPU, timm's scheduler)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from timm.scheduler import CosineLRScheduler

from convbias.base.run_layout import (
    CHECKPOINTS_DIR,
    EMA_FILE,
    MANIFEST_FILE,
    SNAPSHOTS_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    snapshot_file,
)
from convbias.engine import Config
from convbias.engine.checkpoint.manager import CheckpointManager
from convbias.engine.checkpoint.parts import SchedulerState, TrainingProgress, resume_parts
from convbias.engine.checkpoint.points import CheckpointDir
from convbias.engine.checkpoint.resume import ResumePoint, find_resume_point, load_training_state


@dataclass
class Models:
    """The models a manager reads (the engine's are engine.model.build.Models)."""

    accelerator: Accelerator
    model: torch.nn.Module
    in_chans: int = 3
    num_classes: int = 2
    ema: Any = None


@dataclass
class Optimization:
    optimizer: Any
    scheduler: Any


def built(
    output: Path, cfg: Config, point: Path | None = None
) -> tuple[CheckpointManager, Models, Optimization, ResumePoint | None]:
    """A manager as the trainer builds one: the run's folder, options, resume parts and models."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    optimization = Optimization(optimizer, CosineLRScheduler(optimizer, t_initial=4))
    progress = TrainingProgress()
    schedule = SchedulerState(optimization, progress, lambda: CosineLRScheduler(optimizer, t_initial=4), 4, 0.1)
    parts = resume_parts(cfg, accelerator, progress, optimization, schedule, None)
    models = Models(accelerator, model)
    manager = CheckpointManager(CheckpointDir(output, cfg.keep_checkpoints), cfg, parts, models)
    resume = ResumePoint(point, load_training_state(point), {}) if point else None
    return manager, models, optimization, resume


def step(models: Models, optimization: Optimization, progress: TrainingProgress) -> None:
    loss = models.model(torch.ones(4, 3)).square().mean()
    loss.backward()
    optimization.optimizer.step()
    optimization.optimizer.zero_grad()
    progress.num_updates += 1


def test_save_writes_the_points_that_are_due_and_load_restores_them(tmp_path):
    cfg = Config(model="convit_tiny", save_epochs=[1], checkpoint_interval=2, output=str(tmp_path))
    manager, models, optimization, _ = built(tmp_path, cfg)
    assert manager.load(None) is None  # a fresh run
    step(models, optimization, manager.progress)
    assert manager.save(0, 1, loss_sum=torch.tensor(0.5)) is None  # 1 update: not due with --checkpoint-interval 2
    assert manager.points() == []
    step(models, optimization, manager.progress)
    mid = manager.save(0, 2, loss_sum=torch.tensor(0.25))  # due
    assert mid.name == "epoch_0000_step_0000002" and load_training_state(mid)["loss_sums"] == [0.25]
    step(models, optimization, manager.progress)
    forced = manager.save(0, 3, loss_sum=torch.tensor(0.75), force=True)  # a preemption: due whatever the interval
    assert forced.name == "epoch_0000_step_0000003"
    point = manager.save(1, is_best=True)  # the epoch's point, and its --save-epochs snapshot
    assert point.name == "epoch_0001" and {p.name for p in manager.points()} == {"epoch_0001", forced.name}
    root = tmp_path / CHECKPOINTS_DIR
    assert (root / snapshot_file(1)).is_file() and (root / SNAPSHOTS_FILE).is_file()
    assert {p.name for p in point.iterdir()} == {WEIGHTS_FILE, STATE_FILE, MANIFEST_FILE}  # no EMA in this run
    assert not (point / EMA_FILE).exists()
    assert find_resume_point("auto", tmp_path) == point.resolve()

    fresh, fresh_models, fresh_optimization, resume = built(tmp_path, cfg, point)
    assert not torch.equal(fresh_models.model.weight, models.model.weight)  # built afresh: other weights
    assert fresh.load(resume) == f"resumed from {point} after epoch 1"
    assert (fresh.progress.epoch, fresh.progress.step, fresh.progress.num_updates) == (1, 0, 3)
    for name, value in models.model.state_dict().items():
        assert torch.equal(fresh_models.model.state_dict()[name], value)  # the weights, in the same call
    momentum = optimization.optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(fresh_optimization.optimizer.state_dict()["state"][0]["momentum_buffer"], momentum)
    assert fresh.metadata(1)["num_classes"] == "2" and fresh.metadata(1)["in_chans"] == "3"
