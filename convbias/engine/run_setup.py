"""A run's set-up: data, model and starting weights, optimizer, schedule, losses, EMA, teacher, compile and
FSDP, and the resume point's state on top. ``RunSetup(cfg)`` does every check that can fail on user input
(data, model, checkpoints, output dir; engine.run_start) before anything is written; ``engine.trainer``'s
``Trainer`` adds the loop.

Distribution: the model and its optimizer go through ``accelerate.prepare`` together: DDP, or FSDP2 when
the accelerate config asks for FSDP with ``fsdp_version: 2`` (FSDP1 is refused here). The train loader is
*not* prepared: its sampler (from engine.data) shards itself across ranks so that, with a fixed seed, the
union of the ranks' batches at step t is the 1-process batch at step t. The eval loader is prepared; a
stream's loaders are not (timm's reader splits the stream between processes).
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import timm
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from timm.utils import ModelEmaV3

from . import recipe
from .checkpoint import (
    EMA_FILE,
    WEIGHTS_FILE,
    CheckpointDir,
    load_training_state,
    load_weights,
    verify_file,
    weights_metadata,
)
from .compile import compiled
from .config import Config, effective_epochs
from .data import build_datasets, build_eval_loader, build_stream_loader, build_train_loader, dataset_info, first_images
from .diagnostics import ModelDiagnostics
from .errors import ConfigError
from .extensions import Extensions
from .fsdp import FullCopy, load_sharded
from .lock import RunLock
from .modeling import check_model_name, create_model
from .output_scale import OutputScale, ScaledLoss
from .preemption import PreemptionSignals, ignore_in_worker, parse_signals
from .run_dir import point_name
from .run_start import (
    check_exact_continuation,
    check_resume_world_size,
    find_start,
    finished_message,
    resolve_checkpoint,
    take_lock,
)
from .streams import is_stream


class RunSetup:
    """Everything a run needs before its first step; ``Trainer`` (engine.trainer) runs it."""

    def __init__(self, cfg: Config, extensions: Extensions | None = None, lock: RunLock | None = None):
        self.cfg = cfg
        self.extensions = extensions or Extensions()
        set_threads()
        self.accelerator = acc = Accelerator(
            mixed_precision=cfg.mixed_precision,
            gradient_accumulation_steps=cfg.grad_accum_steps,
            log_with="wandb" if cfg.log_wandb and not cfg.eval_only else None,
        )
        self.sharded = acc.is_fsdp2
        self.full_copy: FullCopy | None = None  # under FSDP, what whole_model() returns (made with the optimizer)
        self._check_fsdp()
        self.output = Path(cfg.output)
        self.epochs, self.warmup_epochs = effective_epochs(cfg)
        self.global_batch = cfg.batch_size * acc.num_processes * cfg.grad_accum_steps
        self.lr = cfg.lr if cfg.lr is not None else cfg.lr_base * self.global_batch / cfg.lr_base_size

        check_model_name(cfg.model)
        self._check_reparametrization()
        if cfg.distill_teacher:
            check_model_name(cfg.distill_teacher, "--distill-teacher")
        self.checkpoint_name = resolve_checkpoint(cfg)
        for weights in (cfg.pretrained_file, cfg.distill_teacher_file):  # files of a resume point: checksummed
            if weights:
                verify_file(weights)
        self.notes: list[str] = []  # said when training starts (stale lock taken over, restart)
        self.warnings: list[str] = []  # settings that are likely unintended, said before anything runs
        take_lock(acc, lock, self.notes)
        self.resume_point = find_start(acc, cfg, self.output, self.notes)
        self.resume_state = load_training_state(self.resume_point) if self.resume_point else None
        if self.resume_state and self.resume_state.get("model") != cfg.model:
            raise ConfigError(
                f"--resume {self.resume_point} is a checkpoint of {self.resume_state.get('model')}, "
                f"not of --model {cfg.model}"
            )
        checkpoints = CheckpointDir(self.output)
        if self.resume_point is not None and self.resume_point.parent == checkpoints.root.resolve():
            best = (self.resume_state.get("best") or {}).get("epoch")
            if acc.is_main_process:  # the links follow the training state (a copy may have dropped them)
                self.notes += checkpoints.relink(self.resume_point.name, None if best is None else point_name(best))
        self.finished = finished_message(self.resume_state, self.output, self.epochs, acc.is_main_process)
        if self.finished:  # --resume of a finished run: nothing to set up, nothing more to write
            self.finished = "; ".join(self.notes + [self.finished])
            return

        check_resume_world_size(self.resume_state, self.resume_point, acc.num_processes)
        self.accepted_changes = check_exact_continuation(cfg, self.resume_state, self.resume_point)
        if self.accepted_changes:
            self.notes.append(f"--accept-resume-changes: continuing {self.resume_point} with {self.accepted_changes}")

        cfg.img_size = cfg.img_size or dataset_info(cfg.dataset).default_img_size  # data and model agree
        if not cfg.eval_only:
            self.warnings = setup_warnings(cfg, self.lr, self.global_batch)
        self.data = build_datasets(cfg)
        model = self._build_model()
        self.preemption = PreemptionSignals(parse_signals(cfg.preempt_signals))
        # loader workers leave the preemption signals to this process (see engine.preemption)
        self.worker_init_fn = partial(ignore_in_worker, self.preemption.signals) if self.preemption.signals else None
        self.streamed = is_stream(cfg.dataset)  # timm's reader shards a stream itself: its loaders are not prepared
        if self.streamed:
            self.eval_loader = build_stream_loader(
                self.data.val,
                cfg.eval_batch_size or cfg.batch_size,
                cfg.workers,
                drop_last=False,
                worker_init_fn=self.worker_init_fn,
            )
        else:
            self.eval_loader = build_eval_loader(
                self.data.val, cfg.eval_batch_size or cfg.batch_size, cfg.workers, self.worker_init_fn
            )
        if cfg.eval_only:  # evaluation needs no sharding (and FSDP2 prepares a model only with its optimizer)
            self.model = model.to(acc.device) if self.sharded else acc.prepare(model)
            self.eval_loader = self.eval_loader if self.streamed else acc.prepare(self.eval_loader)
            self.forward = compiled(self.model, cfg, acc.device.type)
        else:
            self._set_up_training(model)

    def _build_model(self) -> torch.nn.Module:
        """The model with its starting weights: a resume point, else --checkpoint, else timm's init/pretrained."""
        cfg = self.cfg
        set_seed(cfg.seed)  # same initial weights on every rank
        model = create_model(cfg, self.data.num_classes, self.data.in_chans)
        if self.resume_state:
            self.reparametrized = self.resume_state["reparametrized"]
        else:  # a checkpoint written after --reparametrize-at-epoch needs the changed architecture
            metadata = weights_metadata(cfg.checkpoint) if cfg.checkpoint else {}
            self.reparametrized = metadata.get("reparametrized") == "True"
            cfg.reparametrize = cfg.reparametrize or metadata.get("reparametrization") or None
            self._check_reparametrization()
            if metadata.get("output_scale"):  # weights of an output-scaled run hold f_w0 too
                cfg.output_scale = cfg.output_scale or float(metadata["output_scale"])
        if self.reparametrized:
            model = self._reparametrized(model)
        if cfg.checkpoint and not self.resume_point:
            if metadata.get("output_scale"):
                model = OutputScale(model, cfg.output_scale)
            self._load_checkpoint(model)
        if self.resume_point:
            if cfg.output_scale:
                model = OutputScale(model, cfg.output_scale)
            load_weights(model, self.resume_point / WEIGHTS_FILE)
        if cfg.grad_checkpointing:
            self._set_grad_checkpointing(model.model if isinstance(model, OutputScale) else model)
        if cfg.output_scale and not isinstance(model, OutputScale):
            model = OutputScale(model, cfg.output_scale)  # f_w0: the network as this run starts
        return model

    def _load_checkpoint(self, model: torch.nn.Module) -> None:
        """--checkpoint's weights; a file that does not fit says how to rebuild the model it was written for."""
        try:
            load_weights(model, self.cfg.checkpoint)
        except ValueError as e:
            if "does not fit" not in str(e):
                raise
            raise ConfigError(
                f"{e}; give the model options the weights were trained with (--model, --model-kwargs, "
                f"--img-size, --num-classes), or pass the run directory, whose config.yaml has them"
            ) from None

    def _set_grad_checkpointing(self, model: torch.nn.Module) -> None:
        """--grad-checkpointing: timm's own switch; the model must have one."""
        if not hasattr(model, "set_grad_checkpointing"):
            raise ConfigError(
                f"--grad-checkpointing: {type(model).__name__} ({self.cfg.model}) has no "
                f"set_grad_checkpointing(); run without it"
            )
        model.set_grad_checkpointing(True)

    def _set_up_training(self, model: torch.nn.Module) -> None:
        """Train loader, optimizer, schedule, losses, EMA, diagnostics; the resume point's state on top."""
        cfg, acc = self.cfg, self.accelerator
        self.teacher = self._create_teacher() if cfg.distill_teacher else None
        if self.streamed:
            self.train_loader = build_stream_loader(
                self.data.train, cfg.batch_size, cfg.workers, drop_last=True, worker_init_fn=self.worker_init_fn
            )
        else:
            self.train_loader = build_train_loader(
                self.data.train,
                cfg.batch_size,
                cfg.workers,
                cfg.repeated_aug,
                cfg.seed,
                acc.num_processes,
                acc.process_index,
                self.worker_init_fn,
            )
        self.steps_per_epoch = len(self.train_loader) // cfg.grad_accum_steps * cfg.grad_accum_steps
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"the training set ({len(self.data.train)} images) gives no full batch of "
                f"{cfg.batch_size} x {acc.num_processes} processes x {cfg.grad_accum_steps} "
                f"accumulation steps; lower --batch-size"
            )
        if hasattr(model, "set_distilled_training") and self.teacher is not None:
            model.set_distilled_training(True)

        before_reparametrization = cfg.reparametrize_at_epoch is not None and not self.reparametrized
        optimizer = recipe.create_optimizer(cfg, model, self.lr, require_all_patterns=not before_reparametrization)
        # the EMA (and under FSDP the full copy) from the model as built, before prepare() shards or wraps it
        self.ema = ModelEmaV3(model, decay=cfg.model_ema_decay, device=acc.device) if cfg.model_ema else None
        self.full_copy = FullCopy(model, acc.device) if self.sharded else None
        if self.sharded:  # every rank has built the whole model; accelerate's rank-0 loading (on by default)
            acc.state.fsdp_plugin.cpu_ram_efficient_loading = False  # serves transformers models only
        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.scheduler = recipe.create_scheduler(
            cfg, self.optimizer, self.epochs, self.warmup_epochs, self.steps_per_epoch // cfg.grad_accum_steps
        )
        self.mixup = recipe.create_mixup(cfg, self.data.num_classes)
        self.train_loss = recipe.create_train_loss(cfg, self.mixup)
        if self.teacher is not None:
            self.train_loss = recipe.HardDistillationLoss(self.train_loss, self.teacher)
        if cfg.output_scale:
            self.train_loss = ScaledLoss(self.train_loss, cfg.output_scale)
        if not self.streamed:
            self.eval_loader = acc.prepare(self.eval_loader)
        self._compile()

        self.start_epoch, self.num_updates = 0, 0
        self.start_step, self.start_loss_sum = 0, 0.0  # the position inside start_epoch of a mid-epoch resume point
        self.best: dict[str, Any] = {}  # epoch, eval_top1, eval_top5 of the best evaluation so far
        self.final: dict[str, Any] = {}  # the latest evaluation
        if self.resume_state:
            self._restore_training_state(self.resume_state)
        self.checkpoints = CheckpointDir(self.output, cfg.keep_checkpoints)
        self.diagnostics = None
        if cfg.diagnostics:
            images = first_images(self.data.val, min(cfg.diagnostics_images, len(self.data.val))).to(acc.device)
            self.diagnostics = ModelDiagnostics(images, self.extensions.diagnostics)

    def _compile(self) -> None:
        """The compiled views used by the training step and evaluation (engine.compile): checkpoints,
        EMA updates, reparametrizations and diagnostics keep using the modules themselves."""
        device_type = self.accelerator.device.type
        self.forward = compiled(self.model, self.cfg, device_type)
        self.ema_forward = compiled(self.ema.module, self.cfg, device_type) if self.ema is not None else None

    def _check_fsdp(self) -> None:
        """FSDP through fsdp_version 2 only, and without a mid-run change of architecture."""
        acc, cfg = self.accelerator, self.cfg
        if acc.distributed_type == DistributedType.FSDP and not self.sharded:
            raise ConfigError(
                "FSDP1 (fsdp_version 1) is not supported: its resume points cannot be continued; set "
                "fsdp_version: 2 in the accelerate config (or --fsdp_version 2), or train with DDP"
            )
        if self.sharded and cfg.reparametrize_at_epoch is not None and not cfg.eval_only:
            raise ConfigError(
                "--reparametrize-at-epoch changes the model's architecture mid-run, which FSDP's "
                "sharded parameters cannot follow; run it with DDP"
            )

    def whole_model(self) -> torch.nn.Module:
        """The model with whole (unsharded) weights, as the EMA update and the diagnostics read it: under FSDP
        an ordinary copy refreshed from the shards (every rank calls it), else the unwrapped module."""
        if self.full_copy is not None:
            return self.full_copy.refresh(self.model)
        return self.accelerator.unwrap_model(self.model)

    def _check_reparametrization(self) -> None:
        """--reparametrize names one of the composition root's reparametrizations (needed by
        --reparametrize-at-epoch, and to rebuild a model from a checkpoint written after one)."""
        name, known = self.cfg.reparametrize, self.extensions.reparametrizations
        if name is not None and name not in known:
            raise ConfigError(f"unknown --reparametrize '{name}'; choices: {', '.join(known) or 'none registered'}")
        if self.cfg.reparametrize_at_epoch is not None and name is None:
            raise ConfigError(
                f"--reparametrize-at-epoch needs --reparametrize NAME; choices: {', '.join(known) or 'none registered'}"
            )

    def _reparametrized(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model after the run's reparametrization (--reparametrize with --reparametrize-kwargs)."""
        if self.cfg.reparametrize is None:
            raise ConfigError(
                "the weights to load were written after a reparametrization: pass the run's "
                "--reparametrize NAME and --reparametrize-kwargs to rebuild its architecture"
            )
        return self.extensions.reparametrizations[self.cfg.reparametrize](model, **self.cfg.reparametrize_kwargs)

    def _create_teacher(self) -> torch.nn.Module:
        cfg = self.cfg
        teacher = timm.create_model(
            cfg.distill_teacher,
            num_classes=self.data.num_classes,
            in_chans=None if self.data.in_chans == 3 else self.data.in_chans,
        )
        load_weights(teacher, cfg.distill_teacher_file)
        return teacher.to(self.accelerator.device).eval()

    def _restore_training_state(self, state: dict) -> None:
        acc = self.accelerator
        if state.get("sharded"):  # weights and optimizer state from every rank's shards, on any number of ranks
            load_sharded(self.resume_point, self.model, self.optimizer.optimizer)
        elif state["optimizer"] is None:
            raise ConfigError(
                f"{self.resume_point} was written under FSDP1, whose sharded optimizer state was not "
                f"saved; start a new run from its weights with --checkpoint instead"
            )
        elif self.sharded:
            raise ConfigError(
                f"{self.resume_point} was written without FSDP: its optimizer state is not sharded; "
                f"continue it without FSDP, or start a new run from its weights with --checkpoint"
            )
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None:
            ema_file = self.resume_point / EMA_FILE
            if ema_file.is_file():
                load_weights(self.ema.module, ema_file)
        if acc.scaler is not None and state.get("scaler"):
            acc.scaler.load_state_dict(state["scaler"])
        self.start_epoch = state["epoch"]
        self.num_updates = state["num_updates"]
        if state.get("step"):
            self.start_step = state["step"]
            self.start_loss_sum = state["loss_sums"][acc.process_index]
        self.best, self.final = state["best"], state["final"]
        self.scheduler.step_update(self.num_updates)


def node_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_processes() -> int:
    """The processes of this launch on this node (torchrun and accelerate's launcher set LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def set_threads() -> None:
    """Intra-op threads per process: the node's cores shared among its processes, unless OMP_NUM_THREADS
    says otherwise (accelerate's --num_cpu_threads_per_process sets it)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, node_cores() // local_processes()))


LOW_LR = 1e-5  # a scaled lr below this barely moves a model in a short run
SMALL_IMAGES = 64  # px: below this the DeiT recipe's augmentation destroys most of an image


def setup_warnings(cfg: Config, lr: float, global_batch: int) -> list[str]:
    """Valid settings that are likely unintended once the world size is known: an lr scaled very low, heavy
    augmentation on small images, more loader workers than the node has cores."""
    warnings = []
    if cfg.lr is None and lr < LOW_LR:
        warnings.append(
            f"the lr scaled to the global batch is {lr:.3g} (--lr-base {cfg.lr_base:g} x {global_batch} / "
            f"--lr-base-size {cfg.lr_base_size}), below {LOW_LR:g}: the run may barely learn; set --lr, or raise "
            f"--lr-base or the batch"
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
        warnings.append(
            f"heavy augmentation ({', '.join(heavy)}) on {cfg.img_size}-px images: the DeiT recipe is made for 224 px "
            f"and leaves little of a small image; use a light recipe (configs/train/demo_digits.yaml) or --no-aug"
        )
    cores, local = node_cores(), local_processes()
    if cfg.workers * local > cores:
        warnings.append(
            f"--workers {cfg.workers} x {local} process{'es' if local > 1 else ''} on this node start "
            f"{cfg.workers * local} loader processes for {cores} core{'s' if cores > 1 else ''}: they compete with "
            f"training; lower --workers"
        )
    return warnings
