"""A run's parts, composed from each package's builder, as a ``Trainer`` (engine.loop.trainer) or an ``Evaluator``
needs them; the run has started (engine.loop.start.start_run: accelerator, lock, resume, checked options).

``build_trainer`` builds the parts, each whole: ``TrainingData`` (engine.data.build: datasets and loaders),
``Models`` (the model from engine.model.factory.create_run_model with its starting weights, the EMA, teacher and
compiled views), ``Optimization`` (engine.optim.build: optimizer, schedule, mixup, loss); what the run resumes is
then restored into them by the checkpoint manager, in one call. ``build_evaluator`` builds what ``--eval-only``
needs.

Distribution: the model and its optimizer go through ``accelerate.prepare`` together: DDP, or FSDP2 when
the accelerate config asks for FSDP with ``fsdp_version: 2`` (FSDP1 is refused at the start). The train loader is
*not* prepared: its sampler (from engine.data.factory) shards itself across ranks so that, with a fixed seed, the
union of the ranks' batches at step t is the 1-process batch at step t. The eval loader is prepared; a
stream's loaders are not (timm's reader splits the stream between processes).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from timm.utils import ModelEmaV3

from convbias.base.weights import EMA_KEYS, load_checked, read_weights, rebuild_hint

from ..checkpointing.shards import FullCopy
from ..checkpointing.timm_checkpoint import read_timm_checkpoint
from ..config.derived import RunValues
from ..config.options import Config
from ..config.parsing import parse_signals
from ..data.build import TrainingData, build_training_data
from ..model.compile import compiled
from ..model.factory import (
    check_head_fits,
    create_run_model,
    create_teacher,
    head_classes,
    head_fit_warning,
    set_grad_checkpointing,
    sync_batchnorm,
)
from ..model.output_scale import OutputScale, ScaledLoss
from ..optim import factory as optim
from ..optim.build import Optimization, build_optimization
from .metrics import evaluate
from .node import busy_cores_warning, local_processes, node_cores
from .preemption import PreemptionSignals, ignore_in_worker
from .records import evaluation_block
from .start import CheckpointChoice, RunStart

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


# --------------------------------------------------------------------------------------------- model
def build_model(start: RunStart, data: TrainingData) -> tuple[torch.nn.Module, bool]:
    """The model with its starting weights (--checkpoint, else timm's init/pretrained; a resumed run's come with
    the rest of its state, in CheckpointManager.load) and whether it has been reparametrized."""
    cfg = start.cfg
    set_seed(cfg.seed)  # same initial weights on every rank
    metadata = start.checkpoint_metadata  # its reparametrization and output scale: in cfg (resolved_options)
    if start.point is not None:
        was_reparametrized = start.point.reparametrized
    else:
        was_reparametrized = metadata.get("reparametrized") == "True"
    in_chans, reparametrizations = data.bundle.in_chans, start.extensions.reparametrizations
    model, start.weights = create_run_model(cfg, start.head[0], in_chans, was_reparametrized, reparametrizations)
    check_head_fits(model, data.bundle.num_classes, f"--dataset {cfg.dataset}")
    # a resume's weights are restored with the rest of its state (CheckpointManager.load); timm's train.py,
    # too, loads --resume over --initial-checkpoint
    if cfg.checkpoint and start.resume is None:
        if metadata.get("output_scale"):
            model = OutputScale(model, cfg.output_scale)
        start.checkpoint = _load_checkpoint(model, start.checkpoint, initial=not cfg.eval_only)
        start.weights = f"{start.checkpoint.name}: all {len(model.state_dict())} tensors loaded"
    if cfg.grad_checkpointing:
        set_grad_checkpointing(model.model if isinstance(model, OutputScale) else model, cfg.model)
    if cfg.output_scale and not isinstance(model, OutputScale):
        model = OutputScale(model, cfg.output_scale)  # f_w0: the network as this run starts
    return model, was_reparametrized


def _load_checkpoint(model: torch.nn.Module, choice: CheckpointChoice, initial: bool) -> CheckpointChoice:
    """--checkpoint's weights into ``model``; returns the choice loaded: a run directory's next verified point
    when the run removed the chosen one meanwhile. A file's EMA comes first where it holds one when training
    starts from it (``initial``), as timm's --initial-checkpoint loads it (``load_checkpoint``'s use_ema=True);
    --eval-only takes the model's, as timm's validate.py does unless --use-ema."""
    with rebuild_hint(choice.weights):
        if choice.timm_ema:  # --use-ema of timm's checkpoint
            load_checked(model, read_timm_checkpoint(choice.weights).weights(use_ema=True), choice.name)
            return choice
        if choice.run is None:
            weights, key = read_weights(choice.weights, use_ema=initial)
            load_checked(model, weights, str(choice.weights))
            return replace(choice, name=f"{choice.name} ({key})") if key in EMA_KEYS else choice
        loaded = choice.run.load_weights(model, choice.which)
        return replace(choice, weights=str(loaded.weights), name=loaded.describe())


@dataclass
class Models:
    """The prepared model (DDP, FSDP2 or bare), its EMA and teacher, and the compiled views that the training
    step and evaluation call (engine.model.compile); checkpoints, EMA updates, reparametrizations and
    diagnostics use the modules themselves."""

    accelerator: Accelerator
    model: torch.nn.Module
    ema: ModelEmaV3 | None = None
    teacher: torch.nn.Module | None = None
    full_copy: FullCopy | None = None  # under FSDP, what whole_model() returns
    num_classes: int = 0  # the classifier's outputs
    forward: Any = None
    ema_forward: Any = None

    def compile(self, cfg: Config) -> None:
        device_type = self.accelerator.device.type
        self.forward = compiled(self.model, cfg, device_type)
        self.ema_forward = compiled(self.ema.module, cfg, device_type) if self.ema is not None else None

    def whole_model(self) -> torch.nn.Module:
        """The model with whole (unsharded) weights, as the EMA update and the diagnostics read it: under FSDP
        an ordinary copy refreshed from the shards (every rank calls it), else the unwrapped module."""
        if self.full_copy is not None:
            return self.full_copy.refresh(self.model)
        return self.accelerator.unwrap_model(self.model)


def build_models_and_optimization(start: RunStart, data: TrainingData) -> tuple[Models, Optimization, bool]:
    """The model with its starting weights, its EMA (and under FSDP its full copy) from the model as built,
    before prepare() shards or wraps it, the teacher, the optimization, the compiled views."""
    cfg, acc = start.cfg, start.accelerator
    model, was_reparametrized = build_model(start, data)
    if cfg.sync_bn:
        model = sync_batchnorm(model, cfg.model, acc)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    teacher = (
        create_teacher(cfg, head_classes(model), data.bundle.in_chans, acc.device) if cfg.distill_teacher else None
    )
    if teacher is not None and hasattr(model, "set_distilled_training"):
        model.set_distilled_training(True)
    ema = optim.create_ema(cfg, model, acc.device)
    full_copy = FullCopy(model, acc.device) if start.sharded else None
    before = cfg.reparametrize_at_epoch is not None and not was_reparametrized
    prepared, optimization = build_optimization(
        cfg, acc, model, start.values, data.updates_per_epoch, head_classes(model), before
    )
    if teacher is not None:
        optimization.train_loss = optim.HardDistillationLoss(optimization.train_loss, teacher)
    if cfg.output_scale:
        optimization.train_loss = ScaledLoss(optimization.train_loss, cfg.output_scale)
    models = Models(acc, prepared, ema, teacher, full_copy, num_classes=head_classes(model))
    models.compile(cfg)
    return models, optimization, was_reparametrized


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
    forward: Any
    warnings: list[str] = field(default_factory=list)

    def run(self) -> dict[str, float]:
        """Top-1, top-5 and loss of the checkpoint over the whole validation set, printed and returned."""
        start, data = self.start, self.data
        for line in evaluation_block(start, data):
            start.accelerator.print(line)
        metrics = evaluate(start.accelerator, self.forward, data.eval_loader, data.streamed, start.cfg.channels_last)
        self.start.accelerator.print(
            f"top1 {metrics['eval_top1']:.2f}  top5 {metrics['eval_top5']:.2f}  "
            f"loss {metrics['eval_loss']:.4f}  ({self.start.checkpoint.name})"
        )
        return metrics


def build_evaluator(start: RunStart) -> Evaluator:
    acc = start.accelerator
    data = build_data(start, build_preemption(start.cfg), train=False)
    model, _ = build_model(start, data)
    if start.cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = model.to(acc.device) if start.sharded else acc.prepare(model)
    return Evaluator(start, data, model, compiled(model, start.cfg, acc.device.type))
