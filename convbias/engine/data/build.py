"""The data a run trains and evaluates on, built whole from its options: datasets, loaders, device augmentation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from accelerate import Accelerator
from torch.utils.data import DataLoader

from convbias.base.errors import ConfigError

from ..config.options import Config
from .device_augment import DeviceAugment
from .factory import DataBundle, build_datasets
from .loaders import build_eval_loader, build_stream_loader, build_train_loader
from .streams import is_stream


@dataclass
class TrainingData:
    """The datasets and their loaders: the train loader shards itself across ranks (engine.data.factory)."""

    bundle: DataBundle
    eval_loader: DataLoader  # accelerate's prepared loader, or a stream's own
    streamed: bool  # timm's reader shards a stream itself: its loaders are not prepared
    worker_init_fn: Callable[[int], None]
    train_loader: DataLoader | None = None
    steps_per_epoch: int = 0  # the train loader's batches: every one is trained on
    updates_per_epoch: int = 0  # optimizer updates: one per --grad-accum-steps batches, and one for the rest
    augment: DeviceAugment | None = None  # the fast path's device half (engine.data.device_augment)


def build_training_data(
    cfg: Config, acc: Accelerator, worker_init_fn: Callable[[int], None], train: bool
) -> TrainingData:
    """The datasets and loaders of ``cfg`` (only the evaluation loader unless ``train``); ``worker_init_fn`` runs
    in every loader worker."""
    bundle = build_datasets(cfg)
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
    data.steps_per_epoch = len(data.train_loader)
    data.updates_per_epoch = (data.steps_per_epoch + cfg.grad_accum_steps - 1) // cfg.grad_accum_steps  # as timm
    if data.steps_per_epoch == 0:
        raise ConfigError(
            f"the training set ({len(bundle.train)} images) gives no full batch of {cfg.batch_size} x "
            f"{acc.num_processes} processes; lower --batch-size"
        )
    return data
