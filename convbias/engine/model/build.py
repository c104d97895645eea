"""A run's models, built whole: the model with its starting weights (``build_model``), its EMA, distillation
teacher and, under FSDP, the full copy the EMA and the diagnostics read (``build_models``); and a finished run's
model rebuilt from its run directory or from timm's checkpoint (``build_run_model``, ``create_timm_model``).

Distribution is not done here: the trainer hands the model and its optimizer to ``accelerate.prepare``
together, then compiles the views the step and evaluation call (``Models.compile``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import timm
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from timm.utils import ModelEmaV3
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from convbias.base.errors import ConfigError, DamagedInputError
from convbias.base.run_layout import CONFIG_FILE
from convbias.base.weights import EMA_KEYS, load_checked, load_weights, read_weights, rebuild_hint, weights_metadata

from ..config.options import DEFAULT_WHICH, Config
from ..rundir.choice import CheckpointChoice
from ..rundir.reader import RunCheckpoint, RunDir
from ..rundir.timm_files import TimmCheckpoint, image_channels, read_timm_checkpoint
from .compile import compiled
from .factory import (
    check_head_fits,
    create_run_model,
    create_teacher,
    head_classes,
    set_grad_checkpointing,
    sync_batchnorm,
)
from .output_scale import OutputScale


def create_ema(cfg: Config, model: nn.Module, device: torch.device) -> ModelEma | None:
    """--model-ema: timm's ModelEmaV3 of the weights. Its decay (with --model-ema-warmup, its warm-up) follows the
    update count it is given, so a resumed run continues it exactly from the saved EMA weights. Built where the model
    is, then moved to ``device``, as timm's train.py builds it on the model's device: timm's ModelEmaV3 told another
    device than the model's updates one tensor at a time; here its update is one multi-tensor op on every device."""
    if not cfg.model_ema:
        return None
    ema = ModelEma(model, decay=cfg.model_ema_decay, use_warmup=cfg.model_ema_warmup)
    return ema.to(device)


class ModelEma(ModelEmaV3):
    """timm's ModelEmaV3 whose update copies the integer buffers (BatchNorm's ``num_batches_tracked``) in one
    multi-tensor op beside the one that interpolates the floating-point tensors; timm's copies them one at a
    time, a kernel per BatchNorm. The same values either way."""

    def apply_update_(self, model: nn.Module, decay: float) -> None:
        if not self.foreach:
            return super().apply_update_(model, decay)
        pairs = list(zip(self.module.state_dict().values(), model.state_dict().values()))
        interpolated = [(ema_v, model_v) for ema_v, model_v in pairs if ema_v.is_floating_point()]
        copied = [(ema_v, model_v) for ema_v, model_v in pairs if not ema_v.is_floating_point()]
        if copied:
            torch._foreach_copy_(*map(list, zip(*copied)))
        if interpolated:
            self._foreach_lerp_(*map(list, zip(*interpolated)), weight=1.0 - decay)


def gathered_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of a sharded model on every rank, in the sharded parameters' dtype and keyed like
    the unsharded model's state dict (a collective)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


class FullCopy:
    """An ordinary copy of a model that is sharded for training, refreshed from the shards on demand."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str):
        self.module = copy.deepcopy(model).to(device)  # the model before fully_shard
        self.module.requires_grad_(False)

    def refresh(self, sharded: torch.nn.Module) -> torch.nn.Module:
        """The copy, now holding the sharded model's current weights (every rank calls it)."""
        self.module.load_state_dict(gathered_state(sharded))
        return self.module


def create_timm_model(checkpoint: TimmCheckpoint, use_ema: bool = False) -> torch.nn.Module:
    """The model ``checkpoint`` holds, in eval mode, built from its train.py arguments as timm's validate.py builds
    it (``timm.create_model(args.model, num_classes, in_chans, global_pool, **model_kwargs)``, the BatchNorm eps
    train.py gave it) and loaded strictly with the model's weights, or with ``use_ema`` its EMA's (validate.py's
    --use-ema). The families' models must be registered (``convbias.families.load_families``)."""
    args, path = checkpoint.args, checkpoint.path
    name = args.get("model")
    if not isinstance(name, str):
        raise DamagedInputError(f"{path} holds no args.model (timm's train.py saves it): its architecture is unknown")
    if not timm.is_model(name):
        raise ConfigError(f"{path}: its args.model {name!r} is not a registered timm model")
    kwargs = dict(args.get("model_kwargs") or {})
    kwargs.pop("checkpoint_path", None)  # timm.create_model would load it; the checkpoint's own weights replace it
    try:
        model = timm.create_model(
            name,
            num_classes=args.get("num_classes"),
            in_chans=image_channels(args),
            global_pool=args.get("gp"),
            bn_eps=args.get("bn_eps"),
            **kwargs,
        )
    except (TypeError, ValueError, RuntimeError, AssertionError) as error:  # the constructor refuses its arguments
        raise ConfigError(f"{path}: timm cannot build {name} from its args ({' '.join(str(error).split())})") from None
    load_checked(model, checkpoint.weights(use_ema), f"{path}" + (" (state_dict_ema)" if use_ema else ""))
    return model.eval()


# --------------------------------------------------------------------------- a finished run's model
def run_model_spec(run: RunDir, which: str = DEFAULT_WHICH) -> dict[str, Any]:
    """What rebuilding the model of ``run`` needs: model, model_kwargs (with --gp as global_pool), img_size,
    in_chans, num_classes, whether it was reparametrized, and the checkpoint (a verified RunCheckpoint). Classes
    and channels come from the checkpoint's metadata, else from the run's config.yaml."""
    return run.reading(which, lambda checkpoint: _spec(run, checkpoint))


def _spec(run: RunDir, checkpoint: RunCheckpoint) -> dict[str, Any]:
    options, metadata = run.options(), weights_metadata(checkpoint.weights)
    num_classes = metadata.get("num_classes") or options.get("num_classes")  # None: the model's default
    in_chans = metadata.get("in_chans") or options.get("in_chans")
    if in_chans is None:
        raise ConfigError(
            f"{checkpoint.weights} records no in_chans in its metadata and {run.path / CONFIG_FILE} names none: "
            f"pass the model options explicitly"
        )
    return {
        "model": options["model"],
        "model_kwargs": {
            **({"global_pool": options["gp"]} if options.get("gp") else {}),
            **(options.get("model_kwargs") or {}),
        },
        "img_size": options.get("img_size"),
        "in_chans": int(in_chans),
        "num_classes": None if num_classes is None else int(num_classes),
        "checkpoint": checkpoint,
        "reparametrized": metadata.get("reparametrized") == "True",
    }


def build_run_model(
    run: RunDir, which: str = DEFAULT_WHICH, extensions: Any = None
) -> tuple[torch.nn.Module, RunCheckpoint]:
    """The model of ``run`` as train.py built it, in eval mode with the verified weights of ``which``: timm's
    registry, the reparametrization the weights were written after (from ``extensions``, the families'), the
    output-scale wrapper of an ``--output-scale`` run. A point the run removes meanwhile gives way to the next
    verified one."""
    return run.reading(which, lambda checkpoint: _run_model(run, checkpoint, extensions))


def _run_model(run: RunDir, checkpoint: RunCheckpoint, extensions: Any) -> tuple[torch.nn.Module, RunCheckpoint]:
    spec, cfg = _spec(run, checkpoint), run.run_config()
    initialization = getattr(extensions, "initialization_kwargs", frozenset())  # the checkpoint replaces them
    reparametrizations = getattr(extensions, "reparametrizations", {}) or {}
    model_kwargs = {k: v for k, v in (cfg.model_kwargs or {}).items() if k not in initialization}
    cfg = cfg.replace(img_size=spec["img_size"], pretrained=False, pretrained_file=None, model_kwargs=model_kwargs)
    model, _ = create_run_model(
        cfg, spec["num_classes"], spec["in_chans"], spec["reparametrized"], reparametrizations, checkpoint.describe()
    )
    if cfg.output_scale is not None:
        model = OutputScale(model, cfg.output_scale)
    load_weights(model, checkpoint.weights)
    return model.eval(), checkpoint


# ---------------------------------------------------------------------------------- a run's models
class ModelStart(Protocol):
    """What building a run's model reads of where it starts (engine.loop.start.RunStart is one)."""

    cfg: Config
    checkpoint: CheckpointChoice  # --checkpoint's weights
    checkpoint_metadata: dict[str, str]  # their metadata ({} when resuming or none)
    resume: Any  # what the run resumes: its weights come with the rest of its state (CheckpointManager.load)
    head: tuple[int | None, str]  # the classifier's size to ask timm for, and why
    reparametrized: bool  # the weights it starts from were written after a reparametrization
    extensions: Any  # the families' reparametrizations (engine.loop.extensions.Extensions)


@dataclass(frozen=True)
class StartingModel:
    """A run's model as it starts, and what its weights are: the start-up block's ``weights:`` line, and the
    --checkpoint choice as loaded (a run directory's next verified point when the run removed the chosen one)."""

    module: torch.nn.Module
    reparametrized: bool
    weights: str | None
    checkpoint: CheckpointChoice


def build_model(start: ModelStart, in_chans: int, data_classes: int, classes_source: str) -> StartingModel:
    """The model with its starting weights (--checkpoint, else timm's init/pretrained; a resumed run's come with
    the rest of its state, in CheckpointManager.load), its head checked against the data's ``data_classes``."""
    cfg, choice = start.cfg, start.checkpoint
    set_seed(cfg.seed)  # same initial weights on every rank
    reparametrizations = start.extensions.reparametrizations
    model, weights = create_run_model(cfg, start.head[0], in_chans, start.reparametrized, reparametrizations)
    check_head_fits(model, data_classes, classes_source)
    # a resume's weights are restored with the rest of its state; timm's train.py, too, loads --resume over
    # --initial-checkpoint
    if cfg.checkpoint and start.resume is None:
        if start.checkpoint_metadata.get("output_scale"):  # weights of an output-scaled run hold f_w0 too
            model = OutputScale(model, cfg.output_scale)
        choice = load_checkpoint(model, choice, initial=not cfg.eval_only)
        weights = f"{choice.name}: all {len(model.state_dict())} tensors loaded"
    if cfg.grad_checkpointing:
        set_grad_checkpointing(model.model if isinstance(model, OutputScale) else model, cfg.model)
    if cfg.output_scale and not isinstance(model, OutputScale):
        model = OutputScale(model, cfg.output_scale)  # f_w0: the network as this run starts
    return StartingModel(model, start.reparametrized, weights, choice)


def load_checkpoint(model: torch.nn.Module, choice: CheckpointChoice, initial: bool) -> CheckpointChoice:
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
    """The run's model (as accelerate prepared it: DDP, FSDP2 or bare), its EMA and teacher, and the compiled
    views that the training step and evaluation call (engine.model.compile); checkpoints, EMA updates,
    reparametrizations and diagnostics use the modules themselves. Attributes, since a reparametrization
    replaces them mid-run."""

    accelerator: Accelerator
    model: torch.nn.Module
    in_chans: int  # the images' channels
    num_classes: int  # the classifier's outputs
    ema: ModelEma | None = None
    teacher: torch.nn.Module | None = None
    full_copy: FullCopy | None = None  # under FSDP, what whole_model() returns
    forward: Callable[..., Any] | None = None
    ema_forward: Callable[..., Any] | None = None

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


def build_models(cfg: Config, acc: Accelerator, model: torch.nn.Module, in_chans: int) -> Models:
    """The run's models around ``model`` (with its starting weights), before accelerate prepares it: --sync-bn,
    channels-last, the distillation teacher, the EMA and under FSDP the full copy, each from the model as built,
    before prepare() shards or wraps it."""
    if cfg.sync_bn:
        model = sync_batchnorm(model, cfg.model, acc)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    classes = head_classes(model)
    teacher = create_teacher(cfg, classes, in_chans, acc.device) if cfg.distill_teacher else None
    if teacher is not None and hasattr(model, "set_distilled_training"):
        model.set_distilled_training(True)
    full_copy = FullCopy(model, acc.device) if acc.is_fsdp2 else None
    return Models(acc, model, in_chans, classes, create_ema(cfg, model, acc.device), teacher, full_copy)
