"""What a resume point's ``training_state.pt`` holds: the ``state_dict()`` of each named part of a run.

A part is anything with ``state_dict()`` / ``load_state_dict(state)`` (torch's optimizers and timm's
schedulers as they are, and the parts below), and ``exact_options``: the options a *mid-epoch* point must be
continued with to give the uninterrupted run's numbers (``engine.checkpoint.resume.check_exact_continuation``).

The model's and the EMA's weights are safetensors files beside it (``CheckpointManager.save``); under FSDP the
weights and the optimizer state are every rank's shards. The file's layout is the one resume points have
always had: the ``progress`` and ``identity`` parts' keys at the top level, every other part under its name,
so a point written before the parts existed loads unchanged. Adding a part is one entry in
its instance in ``resume_parts``, which the trainer hands the checkpoint manager; its ``exact_options`` join
the check by themselves (``continuation_options``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from accelerate.utils import gather_object, set_seed
from timm.scheduler import PlateauLRScheduler

from ..optim.factory import set_scheduled_lr
from .rng import rng_state, set_rng_state

TOP_LEVEL = ("progress", "identity")  # the parts whose keys sit at the top level of the file


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class OptimizerAndScheduler(Protocol):
    """What the optimizer's and the schedule's parts read (engine.optim.build.Optimization is one): attributes,
    since a reparametrization replaces both mid-run."""

    optimizer: Any  # accelerate's prepared optimizer
    scheduler: Any  # timm's scheduler


@dataclass
class TrainingProgress:
    """Where the loop is and what it has measured: epochs done, steps into the next one (a mid-epoch point),
    optimizer updates, each rank's loss sum so far in the epoch, and the best and latest evaluations."""

    epoch: int = 0
    step: int = 0
    num_updates: int = 0
    loss_sums: list[float] = field(default_factory=list)  # one per rank, at `step`
    best: dict[str, Any] = field(default_factory=dict)  # epoch, eval_top1, eval_top5 of the best evaluation
    final: dict[str, Any] = field(default_factory=dict)  # the latest evaluation
    ranked: list[dict[str, Any]] = field(default_factory=list)  # the --checkpoint-hist best evaluations, best first
    initial_diagnostics: dict[str, Any] = field(default_factory=dict)  # kept by a point inside the first epoch
    reparametrized: bool = False  # the model's architecture was changed (--reparametrize-at-epoch)

    # the batches of a partly done epoch, and their order, follow from these
    exact_options = ("dataset", "train_fraction", "seed", "batch_size", "grad_accum_steps")

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in asdict(self):
            setattr(self, key, state.get(key, getattr(self, key)))


@dataclass
class RunIdentity:
    """Which model the point belongs to and the options its exact continuation needs (as this run set them)."""

    model: str
    options: dict[str, Any]
    sharded: bool  # written under FSDP: the optimizer state is in the shards, not in this file

    exact_options = ("model", "model_kwargs")  # the architecture the weights fit

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model, "options": self.options, "sharded": self.sharded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The identity is checked at set-up (engine.loop.setup), never overwritten by a point."""


class OptimizerState:
    """The optimizer's part of a resume point: its state_dict, or None under FSDP, whose shards hold it."""

    def __init__(self, optimization: OptimizerAndScheduler, sharded: bool):
        self.optimization, self.sharded = optimization, sharded

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.sharded else self.optimization.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimization.optimizer.load_state_dict(state)


class SchedulerState:
    """The schedule's part: timm's scheduler state, and the lr set again for the point's update and epoch. timm's
    plateau scheduler saves only its best metric; its patience and cooldown counters (torch's ReduceLROnPlateau
    inside it) are saved here too, so a resumed run decays the lr when the uninterrupted one does."""

    def __init__(
        self,
        optimization: OptimizerAndScheduler,
        progress: TrainingProgress,
        create: Callable[[], Any],
        updates_per_epoch: int,
        lr: float,
    ):
        self.optimization, self.progress, self.create = optimization, progress, create
        self.updates_per_epoch, self.lr = updates_per_epoch, lr  # the run's own lr, where a fresh schedule starts

    def recreate(self) -> None:
        """The schedule created again over the optimizer's current groups (their initial_lr), stepped to the
        progress' update and epoch: what a checkpoint without this engine's scheduler state continues with."""
        self.optimization.scheduler = self.create()
        set_scheduled_lr(self.optimization.scheduler, self.progress.num_updates, self.progress.epoch)

    def state_dict(self) -> dict[str, Any]:
        scheduler = self.optimization.scheduler
        state = scheduler.state_dict()
        if isinstance(scheduler, PlateauLRScheduler):
            state["plateau"] = scheduler.lr_scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scheduler = self.optimization.scheduler
        scheduler.load_state_dict(state)
        if isinstance(scheduler, PlateauLRScheduler) and "plateau" in state:
            scheduler.lr_scheduler.load_state_dict(state["plateau"])
        set_scheduled_lr(scheduler, self.progress.num_updates, self.progress.epoch)


class PerRankStreams:
    """A part holding every rank's random streams: saving gathers them from every rank (a collective); a point
    written by another number of processes cannot replay its ranks' streams, so fresh ones are seeded from
    (seed, rank, epoch). Subclasses say what one rank's streams are."""

    def __init__(self, accelerator: Any, seed: int, progress: TrainingProgress):
        self.accelerator, self.seed, self.progress = accelerator, seed, progress

    def local_state(self) -> Any:
        raise NotImplementedError

    def load_local(self, state: Any) -> None:
        raise NotImplementedError

    def reseed(self, seed: int, rank: int, epoch: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> list[Any]:
        return gather_object([self.local_state()])

    def load_state_dict(self, world: list[Any]) -> None:
        acc = self.accelerator
        if len(world) == acc.num_processes:
            self.load_local(world[acc.process_index])
        else:
            self.reseed(self.seed, acc.process_index, self.progress.epoch)


class RandomStreams(PerRankStreams):
    """Every rank's RNG states (python, numpy, torch, cuda): a resumed epoch draws the same augmentations and
    drop-path masks."""

    def local_state(self) -> dict[str, Any]:
        return rng_state()

    def load_local(self, state: dict[str, Any]) -> None:
        set_rng_state(state)

    def reseed(self, seed: int, rank: int, epoch: int) -> None:
        set_seed(seed + 1000 * epoch + rank)


class AugmentStreams(PerRankStreams):
    """Every rank's streams of the device-side augmentation (engine.data.device_augment.DeviceAugment): a resumed
    epoch draws the same RandAugment ops and erasing boxes."""

    exact_options = ("no_prefetcher", "aa", "reprob", "img_size", "interpolation")  # what the streams draw for

    def __init__(self, accelerator: Any, seed: int, progress: TrainingProgress, augment: Any):
        super().__init__(accelerator, seed, progress)
        self.augment = augment

    def local_state(self) -> dict[str, Any]:
        return self.augment.state_dict()

    def load_local(self, state: dict[str, Any]) -> None:
        self.augment.load_state_dict(state)

    def reseed(self, seed: int, rank: int, epoch: int) -> None:
        self.augment.reseed(seed, rank, epoch)


def continuation_options() -> tuple[str, ...]:
    """Every option a mid-epoch point must be continued with, as the kinds of part declare them (the device
    augmentation's too in a run without one: turning it on or off changes what the epoch draws)."""
    names: list[str] = []
    for part in (RunIdentity, TrainingProgress, AugmentStreams):
        names += [name for name in part.exact_options if name not in names]
    return tuple(names)


def resume_parts(
    cfg: Any,
    accelerator: Any,
    progress: TrainingProgress,
    optimization: OptimizerAndScheduler,
    schedule: SchedulerState,
    augment: Any,
) -> dict[str, Stateful]:
    """The named parts a resume point holds, each over the run's live objects (the weights are files beside
    them): what the trainer hands its checkpoint manager."""
    sharded = accelerator.is_fsdp2
    exact = {key: getattr(cfg, key) for key in continuation_options()}
    parts: dict[str, Stateful] = {
        "identity": RunIdentity(cfg.model, exact, sharded),
        "progress": progress,
        "optimizer": OptimizerState(optimization, sharded),
        "scheduler": schedule,
        "rng": RandomStreams(accelerator, cfg.seed, progress),
    }
    if augment is not None:  # the device half of the input pipeline
        parts["augment"] = AugmentStreams(accelerator, cfg.seed, progress, augment)
    if accelerator.scaler is not None:  # fp16: torch's GradScaler is a part as it is
        parts["scaler"] = accelerator.scaler
    return parts


def resume_state(parts: dict[str, Stateful]) -> dict[str, Any]:
    """The content of training_state.pt: the progress part's keys at the top, the others by name."""
    state: dict[str, Any] = {}
    for name, part in parts.items():
        if name in TOP_LEVEL:
            state.update(part.state_dict())
        else:
            state[name] = part.state_dict()
    return state


def restore(parts: dict[str, Stateful], state: dict[str, Any]) -> None:
    """Load each part from a training state written by ``resume_state`` (or before the parts existed); a part
    the point does not hold (a scaler first used on resume) keeps its fresh state."""
    for name, part in parts.items():
        value = state if name in TOP_LEVEL else state.get(name)
        if value is not None:
            part.load_state_dict(value)
