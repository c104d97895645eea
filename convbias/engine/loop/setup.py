"""A run's set-up, as the parts a ``Trainer`` (engine.loop.trainer) or an ``Evaluator`` is composed of.

``start_run`` decides where the run starts (accelerator, lock, resume point) and does every check that can
fail on user input before anything is built or written; a run that is already finished ends there. It derives
the run's values once (``config.derived.RunValues``) and fills the options the checks leave open into a frozen
copy of the Config (``resolved_options``): nothing changes the options after that.
``build_trainer`` then builds the parts, each whole: ``TrainingData`` (datasets and loaders), ``Models``
(model, EMA, teacher, their compiled views), ``Optimization`` (optimizer, schedule, mixup, loss), and the
resume point's state loaded into them; ``build_evaluator`` builds what ``--eval-only`` needs.

Distribution: the model and its optimizer go through ``accelerate.prepare`` together: DDP, or FSDP2 when
the accelerate config asks for FSDP with ``fsdp_version: 2`` (FSDP1 is refused here). The train loader is
*not* prepared: its sampler (from engine.data.factory) shards itself across ranks so that, with a fixed seed, the
union of the ranks' batches at step t is the 1-process batch at step t. The eval loader is prepared; a
stream's loaders are not (timm's reader splits the stream between processes).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import timm
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from timm.utils import ModelEmaV3

from convbias.base.errors import ConfigError
from convbias.base.weights import load_weights, rebuild_hint, weights_metadata

from ..checkpointing.lock import RunLock
from ..checkpointing.resume import Resume, ResumePoint, find_resume
from ..checkpointing.run_dir import verify_file
from ..checkpointing.shards import FullCopy
from ..checkpointing.timm_checkpoint import TimmCheckpoint
from ..config.derived import RunValues
from ..config.options import Config
from ..config.parsing import option_source, parse_signals
from ..data.device_augment import DeviceAugment
from ..data.factory import build_datasets, dataset_info
from ..data.loaders import build_eval_loader, build_stream_loader, build_train_loader
from ..data.streams import is_stream
from ..model.compile import compiled
from ..model.factory import check_head_fits, check_model_name, create_run_model, head_classes
from ..model.output_scale import OutputScale, ScaledLoss
from ..model.pretrained import check_pretrained_reachable
from ..optim import factory as optim
from .extensions import Extensions
from .metrics import evaluate
from .node import local_processes, node_cores, set_threads
from .preemption import PreemptionSignals, ignore_in_worker
from .start import (
    CheckpointChoice,
    check_resume_options,
    check_resume_world_size,
    finished_message,
    resolve_checkpoint,
    take_lock,
)


@dataclass
class RunStart:
    """Where a run starts, decided before anything is built or written."""

    cfg: Config  # the checked options, resolved by the set-up (resolved_options) and frozen
    extensions: Extensions
    accelerator: Accelerator
    output: Path
    values: RunValues  # what the run derives from its options: epochs, global batch, lr
    checkpoint: CheckpointChoice  # --checkpoint's weights, their name in messages, the run they were chosen in
    checkpoint_metadata: dict[str, str]  # the metadata of --checkpoint's weights ({} when resuming or none)
    resume: Resume | None  # what the run continues (engine.checkpointing.resume); None for a fresh run
    notes: list[str] = field(default_factory=list)  # said when training starts (stale lock taken over, restart)
    finished: str | None = None  # --resume of a run that trained all its epochs: what to say instead
    threads: str = ""  # where the intra-op threads came from (engine.loop.node.set_threads)
    weights: str | None = None  # the starting weights and what loading them did (set when the model is built)
    head: tuple[int | None, str] = (None, "")  # the classifier's size asked of timm (None: the model's) and why

    @property
    def sharded(self) -> bool:
        return self.accelerator.is_fsdp2

    @property
    def point(self) -> ResumePoint | None:
        """This engine's resume point the run continues, if it continues one."""
        return self.resume if isinstance(self.resume, ResumePoint) else None


def start_run(cfg: Config, extensions: Extensions | None, lock: RunLock | None) -> RunStart:
    """The accelerator, the checks that need no data, the lock and the resume point."""
    extensions = extensions or Extensions()
    threads = set_threads(cfg.workers)
    acc = Accelerator(
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.grad_accum_steps,
        log_with="wandb" if cfg.log_wandb and not cfg.eval_only else None,
    )
    _check_fsdp(acc, cfg)
    check_model_name(cfg.model)
    if cfg.pretrained and not cfg.pretrained_file:
        check_pretrained_reachable(cfg.model)
    check_reparametrization(cfg, extensions)
    if cfg.distill_teacher:
        check_model_name(cfg.distill_teacher, "--distill-teacher")
    choice = resolve_checkpoint(cfg)
    for weights in (cfg.pretrained_file, cfg.distill_teacher_file):  # files of a resume point: checksummed
        if weights:
            verify_file(weights)
    values = RunValues.derive(cfg, acc.num_processes, optim.trained_epochs(cfg))
    output, notes = Path(cfg.output), []
    take_lock(acc, lock, notes)
    resume = find_resume(acc, cfg, output, values.epochs, notes)
    point = resume if isinstance(resume, ResumePoint) else None
    if point is not None:
        check_resume_options(cfg, output, point.path)
    metadata = weights_metadata(choice.weights) if choice.weights and point is None else {}
    cfg = resolved_options(cfg, choice.weights, metadata, extensions)
    start = RunStart(cfg, extensions, acc, output, values, choice, metadata, resume, notes)
    start.threads = threads
    start.head = requested_head(cfg, metadata, resume)
    state = point.state if point is not None else None
    finished = finished_message(state, output, values.epochs, acc.is_main_process)
    if finished:
        start.finished = "; ".join([*notes, finished])
    else:
        check_resume_world_size(state, point and point.path, acc.num_processes)
    return start


def resolved_options(cfg: Config, checkpoint: str | None, metadata: dict[str, str], extensions: Extensions) -> Config:
    """The run's options with what the checks leave open filled in, as a frozen copy: --checkpoint's weights file
    (a run directory names its checkpoints/<--which>), the image size (the data set's when not given: data and
    model agree), and from the metadata of --checkpoint's weights the reparametrization and output scale they
    were written with (a checkpoint written after --reparametrize-at-epoch needs the changed architecture;
    weights of an output-scaled run hold f_w0 too)."""
    changes: dict[str, Any] = {"img_size": cfg.img_size or dataset_info(cfg.dataset).default_img_size}
    if checkpoint is not None:
        changes["checkpoint"] = checkpoint
    if metadata:
        changes["reparametrize"] = cfg.reparametrize or metadata.get("reparametrization") or None
        if metadata.get("output_scale"):
            changes["output_scale"] = cfg.output_scale or float(metadata["output_scale"])
    resolved = cfg.resolved(**changes)
    check_reparametrization(resolved, extensions)
    return resolved


def requested_head(cfg: Config, metadata: dict[str, str], resume: Resume | None) -> tuple[int | None, str]:
    """(the classifier's size to build, the rule that gave it): --num-classes as timm's train.py reads it (the
    command line or a recipe), else the head of the weights the run continues or evaluates (a resume point, a
    timm checkpoint's args, --checkpoint's metadata), else None: the model's default, as timm."""
    if cfg.num_classes is not None:
        source = option_source(cfg, "num_classes")
        return cfg.num_classes, "recipe" if source.startswith("recipe") else source
    recorded = resume.metadata if isinstance(resume, ResumePoint) else metadata
    if isinstance(resume, TimmCheckpoint) and resume.args.get("num_classes"):
        return int(resume.args["num_classes"]), "the resumed checkpoint's args"
    if recorded.get("num_classes"):
        return int(recorded["num_classes"]), "the weights' head"
    return None, "model default, as timm"


def _check_fsdp(acc: Accelerator, cfg: Config) -> None:
    """FSDP through fsdp_version 2 only, and without a mid-run change of architecture."""
    if acc.distributed_type == DistributedType.FSDP and not acc.is_fsdp2:
        raise ConfigError(
            "FSDP1 (fsdp_version 1) is not supported: its resume points cannot be continued; set "
            "fsdp_version: 2 in the accelerate config (or --fsdp_version 2), or train with DDP"
        )
    if acc.is_fsdp2 and cfg.clip_grad is not None and cfg.clip_mode != "norm" and not cfg.eval_only:
        raise ConfigError(
            f"--clip-mode {cfg.clip_mode} is not supported under FSDP (its gradients are sharded); use --clip-mode "
            f"norm, or train with DDP"
        )
    if acc.is_fsdp2 and cfg.reparametrize_at_epoch is not None and not cfg.eval_only:
        raise ConfigError(
            "--reparametrize-at-epoch changes the model's architecture mid-run, which FSDP's "
            "sharded parameters cannot follow; run it with DDP"
        )


def check_reparametrization(cfg: Config, extensions: Extensions) -> None:
    """--reparametrize names one of the composition root's reparametrizations (needed by
    --reparametrize-at-epoch, and to rebuild a model from a checkpoint written after one)."""
    name, known = cfg.reparametrize, extensions.reparametrizations
    if name is not None and name not in known:
        raise ConfigError(f"unknown --reparametrize '{name}'; choices: {', '.join(known) or 'none registered'}")
    if cfg.reparametrize_at_epoch is not None and name is None:
        raise ConfigError(
            f"--reparametrize-at-epoch needs --reparametrize NAME; choices: {', '.join(known) or 'none registered'}"
        )


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
@dataclass
class TrainingData:
    """The datasets and their loaders: the train loader shards itself across ranks (engine.data.factory)."""

    bundle: Any  # engine.data.factory.DataBundle
    eval_loader: Any
    streamed: bool  # timm's reader shards a stream itself: its loaders are not prepared
    worker_init_fn: Any
    train_loader: Any = None
    steps_per_epoch: int = 0
    augment: DeviceAugment | None = None  # the fast path's device half (engine.data.device_augment)


def build_data(start: RunStart, preemption: PreemptionSignals, train: bool) -> TrainingData:
    cfg, acc = start.cfg, start.accelerator
    bundle = build_datasets(cfg)
    if crowded_loaders(cfg.workers):  # the engine's warning says it once, counting the node's processes
        warnings.filterwarnings("ignore", message=TORCH_WORKERS_WARNING, category=UserWarning)
    # loader workers leave the preemption signals to this process (see engine.loop.preemption)
    worker_init_fn = partial(ignore_in_worker, preemption.signals) if preemption.signals else None
    streamed, eval_batch = is_stream(cfg.dataset), cfg.eval_batch_size or cfg.batch_size
    if streamed:
        eval_loader = build_stream_loader(bundle.val, eval_batch, cfg.workers, False, worker_init_fn, cfg.pin_mem)
    else:
        eval_loader = acc.prepare(build_eval_loader(bundle.val, eval_batch, cfg.workers, worker_init_fn, cfg.pin_mem))
    data = TrainingData(bundle, eval_loader, streamed, worker_init_fn)
    if not train:
        return data
    if streamed:
        data.train_loader = build_stream_loader(
            bundle.train, cfg.batch_size, cfg.workers, True, worker_init_fn, cfg.pin_mem
        )
    else:
        data.train_loader = build_train_loader(
            bundle.train,
            cfg.batch_size,
            cfg.workers,
            cfg.repeated_aug,
            cfg.seed,
            acc.num_processes,
            acc.process_index,
            worker_init_fn,
            cfg.pin_mem,
        )
    if bundle.device_spec is not None:
        data.augment = DeviceAugment(bundle.device_spec, acc.device, seed=cfg.seed, rank=acc.process_index)
    data.steps_per_epoch = len(data.train_loader) // cfg.grad_accum_steps * cfg.grad_accum_steps
    if data.steps_per_epoch == 0:
        raise ConfigError(
            f"the training set ({len(bundle.train)} images) gives no full batch of {cfg.batch_size} x "
            f"{acc.num_processes} processes x {cfg.grad_accum_steps} accumulation steps; lower --batch-size"
        )
    return data


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
        start.checkpoint = _load_checkpoint(model, start.checkpoint)
        start.weights = f"{start.checkpoint.name}: all {len(model.state_dict())} tensors loaded"
    if cfg.grad_checkpointing:
        _set_grad_checkpointing(model.model if isinstance(model, OutputScale) else model, cfg.model)
    if cfg.output_scale and not isinstance(model, OutputScale):
        model = OutputScale(model, cfg.output_scale)  # f_w0: the network as this run starts
    return model, was_reparametrized


def _load_checkpoint(model: torch.nn.Module, choice: CheckpointChoice) -> CheckpointChoice:
    """--checkpoint's weights into ``model``; returns the choice loaded: a run directory's next verified point
    when the run removed the chosen one meanwhile."""
    with rebuild_hint(choice.weights):
        if choice.run is None:
            load_weights(model, choice.weights)
            return choice
        loaded = choice.run.load_weights(model, choice.which)
        return replace(choice, weights=str(loaded.weights), name=loaded.describe())


def _set_grad_checkpointing(model: torch.nn.Module, name: str) -> None:
    """--grad-checkpointing: timm's own switch; the model must have one."""
    if not hasattr(model, "set_grad_checkpointing"):
        raise ConfigError(
            f"--grad-checkpointing: {type(model).__name__} ({name}) has no set_grad_checkpointing(); run without it"
        )
    model.set_grad_checkpointing(True)


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


def has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def sync_batchnorm(model: torch.nn.Module, name: str, acc: Accelerator) -> torch.nn.Module:
    """--sync-bn: torch's SyncBatchNorm in place of every BatchNorm when more than one process trains (as
    timm's train.py; one process has nothing to synchronize)."""
    if not has_batchnorm(model):
        raise ConfigError(f"--sync-bn: {name} has no BatchNorm layers; run without it")
    if acc.num_processes == 1:
        return model
    if acc.device.type == "cpu":
        raise ConfigError("--sync-bn needs GPUs (torch's SyncBatchNorm does not run on CPUs); use --dist-bn")
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)


def create_teacher(cfg: Config, data: TrainingData, num_classes: int, device: torch.device) -> torch.nn.Module:
    in_chans = data.bundle.in_chans
    teacher = timm.create_model(
        cfg.distill_teacher, num_classes=num_classes, in_chans=None if in_chans == 3 else in_chans
    )
    load_weights(teacher, cfg.distill_teacher_file)
    return teacher.to(device).eval()


# -------------------------------------------------------------------------------------- optimization
@dataclass
class Optimization:
    """What turns a loss into an update: optimizer, schedule, mixup/cutmix and the training loss."""

    optimizer: Any  # accelerate's AcceleratedOptimizer
    scheduler: Any  # a timm scheduler, stepped per update
    mixup: Any
    train_loss: Any


def build_optimization(start: RunStart, data: TrainingData, model: torch.nn.Module, before_reparametrization: bool):
    """(prepared model, Optimization): the model and its optimizer go through accelerate.prepare together."""
    cfg, acc = start.cfg, start.accelerator
    optimizer = optim.create_optimizer(cfg, model, start.values.lr, require_all_patterns=not before_reparametrization)
    if start.sharded:  # every rank has built the whole model; accelerate's rank-0 loading (on by default)
        acc.state.fsdp_plugin.cpu_ram_efficient_loading = False  # serves transformers models only
    model, optimizer = acc.prepare(model, optimizer)
    updates_per_epoch = data.steps_per_epoch // cfg.grad_accum_steps
    scheduler = optim.create_scheduler(
        cfg, optimizer, start.values.schedule_epochs, start.values.warmup_epochs, updates_per_epoch
    )
    mixup = optim.create_mixup(cfg, head_classes(model))  # the head's size, as timm's Mixup targets
    return model, Optimization(optimizer, scheduler, mixup, optim.create_train_loss(cfg, mixup).to(acc.device))


def build_models_and_optimization(start: RunStart, data: TrainingData) -> tuple[Models, Optimization, bool]:
    """The model with its starting weights, its EMA (and under FSDP its full copy) from the model as built,
    before prepare() shards or wraps it, the teacher, the optimization, the compiled views."""
    cfg, acc = start.cfg, start.accelerator
    model, was_reparametrized = build_model(start, data)
    if cfg.sync_bn:
        model = sync_batchnorm(model, cfg.model, acc)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    teacher = create_teacher(cfg, data, head_classes(model), acc.device) if cfg.distill_teacher else None
    if teacher is not None and hasattr(model, "set_distilled_training"):
        model.set_distilled_training(True)
    ema = optim.create_ema(cfg, model, acc.device)
    full_copy = FullCopy(model, acc.device) if start.sharded else None
    before = cfg.reparametrize_at_epoch is not None and not was_reparametrized
    prepared, optimization = build_optimization(start, data, model, before)
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
