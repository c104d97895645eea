"""What a run needs beside its trainer: its data with the loader workers set up for preemption (``build_data``),
the warnings said before the first epoch (``training_warnings``), and ``--eval-only``'s ``Evaluator``; the run has
started (engine.loop.start.start_run: accelerator, lock, resume, checked options).

The train loader is *not* prepared by accelerate: its sampler (engine.data.loaders) shards itself across ranks
so that, with a fixed seed, the union of the ranks' batches at step t is the 1-process batch at step t. The eval
loader is prepared; a stream's loaders are not (timm's reader splits the stream between processes).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ..config.derived import RunValues
from ..config.options import Config
from ..config.parsing import parse_signals
from ..data.build import TrainingData, build_training_data
from ..model.build import Models, build_model
from ..model.compile import compiled
from ..model.factory import (
    head_fit_warning,
)
from ..rundir.choice import CheckpointChoice
from .metrics import evaluate
from .node import busy_cores_warning, local_processes, node_cores
from .preemption import PreemptionSignals, ignore_in_worker
from .records import evaluation_block
from .start import RunStart

LOW_LR = 1e-5  # a scaled lr below this barely moves a model in a short run
SMALL_IMAGES = 64  # px: below this the DeiT recipe's augmentation destroys most of an image


def setup_warnings(cfg: Config, values: RunValues) -> list[str]:
    """Valid settings that are likely unintended once the world size is known: an lr scaled very low, heavy
    augmentation on small images, more loader workers than the node has cores."""
    found = []
    if cfg.lr is None and values.lr < LOW_LR:
        found.append(
            f"the lr scaled to the global batch is {values.lr:.3g} ({values.lr_rule}), below {LOW_LR:g}: "
            "the run may barely learn; set --lr, or raise --lr-base or the batch"
        )
    heavy = [
        name
        for name, active in (
            (f"--aa {cfg.aa}", cfg.aa not in (None, "none")),
            (f"--mixup {cfg.mixup:g}", cfg.mixup > 0),
            (f"--cutmix {cfg.cutmix:g}", cfg.cutmix > 0),
            (f"--reprob {cfg.reprob:g}", cfg.reprob > 0),
            (f"--repeated-aug {cfg.repeated_aug}", cfg.repeated_aug > 1),
        )
        if active
    ]
    if heavy and not cfg.no_aug and cfg.img_size < SMALL_IMAGES:
        found.append(
            f"heavy augmentation ({', '.join(heavy)}) on {cfg.img_size}-px images: recipes like DeiT's are made for 224 "
            f"px and leave little of a small image; use a light recipe (configs/train/demo_digits.yaml) or --no-aug"
        )
    crowded = crowded_loaders(cfg.workers)
    if crowded:
        found.append(crowded)
    return found


def training_warnings(start: RunStart, data: TrainingData, models: Models) -> list[str]:
    """What a user needs to hear before the first epoch: ``setup_warnings``, a head larger than the data's class
    count when the options or the model's default chose it (weights that fix the head are not the options'), and
    on CPUs intra-op threads beyond the cores the node's load leaves free."""
    cfg = start.cfg
    found = setup_warnings(cfg, start.values)
    if cfg.num_classes is not None or start.head[0] is None:
        found.append(
            head_fit_warning(models.num_classes, start.head[1], data.bundle.num_classes, f"--dataset {cfg.dataset}")
        )
    if start.accelerator.device.type == "cpu":
        found.append(busy_cores_warning(torch.get_num_threads()))
    return [warning for warning in found if warning]


# torch's DataLoader warns of more workers than cores on its own, at creation and at each new iterator
TORCH_WORKERS_WARNING = r"This DataLoader will create \d+ worker processes in total"


def crowded_loaders(workers: int) -> str | None:
    """The warning of more loader processes on this node than it has cores, or None."""
    cores, local = node_cores(), local_processes()
    if workers * local <= cores:
        return None
    return (
        f"--workers {workers} x {local} process{'es' if local > 1 else ''} on this node start "
        f"{workers * local} loader processes for {cores} core{'s' if cores > 1 else ''}: they compete with "
        f"training; lower --workers"
    )


# ---------------------------------------------------------------------------------------------- data
def build_data(start: RunStart, preemption: PreemptionSignals, train: bool) -> TrainingData:
    """The run's data (engine.data.build), its loader workers leaving the preemption signals to this process
    (engine.loop.preemption)."""
    if crowded_loaders(start.cfg.workers):  # the engine's warning says it once, counting the node's processes
        warnings.filterwarnings("ignore", message=TORCH_WORKERS_WARNING, category=UserWarning)
    worker_init_fn = partial(ignore_in_worker, preemption.handled)
    return build_training_data(start.cfg, start.accelerator, worker_init_fn, train)


def build_preemption(cfg: Config) -> PreemptionSignals:
    return PreemptionSignals(parse_signals(cfg.preempt_signals))


# ------------------------------------------------------------------------------------------ evaluation
@dataclass
class Evaluator:
    """--eval-only: the checkpoint's model and the validation loader (no sharding: FSDP2 prepares a model only
    with its optimizer)."""

    start: RunStart
    data: TrainingData
    model: torch.nn.Module
    forward: Callable[..., Any]
    checkpoint: CheckpointChoice  # the weights evaluated, as loaded
    warnings: list[str] = field(default_factory=list)

    def run(self) -> dict[str, float]:
        """Top-1, top-5 and loss of the checkpoint over the whole validation set, printed and returned."""
        start, data = self.start, self.data
        for line in evaluation_block(start, data, self.checkpoint.name):
            start.accelerator.print(line)
        metrics = evaluate(start.accelerator, self.forward, data.eval_loader, data.streamed, start.cfg.channels_last)
        self.start.accelerator.print(
            f"top1 {metrics['eval_top1']:.2f}  top5 {metrics['eval_top5']:.2f}  "
            f"loss {metrics['eval_loss']:.4f}  ({self.checkpoint.name})"
        )
        return metrics


def build_evaluator(start: RunStart) -> Evaluator:
    acc, cfg = start.accelerator, start.cfg
    data = build_data(start, build_preemption(cfg), train=False)
    built = build_model(start, data.bundle.in_chans, data.bundle.num_classes, f"--dataset {cfg.dataset}")
    model = built.module
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = model.to(acc.device) if start.sharded else acc.prepare(model)
    return Evaluator(start, data, model, compiled(model, cfg, acc.device.type), built.checkpoint)
