"""The loaders: the train sampler that shards itself across ranks (plain shuffle or repeated augmentation),
per-sample seeded augmentation, the stream and eval loaders, and an epoch's batches from any step."""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import contextmanager
from itertools import islice

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from convbias.base.errors import ConfigError

from ..config.parsing import check_option


class ShardedSampler(Sampler[int]):
    """Seeded shuffling sampler that shards itself across processes, with optional repeated
    augmentation (DeiT: each drawn image appears `repeats` times in a row, so its copies land on
    different ranks, or in the same batch on one process).

    An epoch is `len(dataset)` draws, as in DeiT, for any repeats. The epoch order is one global list
    (seeded by (seed, epoch), independent of the number of processes); rank r takes every
    num_replicas-th entry from r, truncated to len(dataset) // num_replicas. Hence, with a loader that
    drops the last partial batch, the union of the ranks' batches at step t is exactly the batch a
    single process with the global batch size draws at step t. Unlike timm's RepeatAugSampler there
    is no rounding down to multiples of 256, so tiny datasets work.

    The sampler also owns the generator the DataLoader draws its worker base seed from, reseeded in
    `set_epoch` from (seed, epoch, rank): the augmentations of worker processes are reproducible
    per epoch, which a resumed run needs (with workers=0 they use the global RNGs).

    With `per_sample_seeds` it yields (index, seed) pairs instead, the seed a function of (seed, epoch,
    position in the epoch's global order) only; `SeededSamples` runs the dataset's transform under it.
    A sample's augmentation then depends neither on the number of workers nor on which worker loads it,
    so a run resumed in the middle of an epoch (`set_epoch(epoch, start)`) draws exactly the
    augmentations of the uninterrupted run. The training loader uses this.
    """

    def __init__(
        self,
        num_samples: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        repeats: int = 1,
        shuffle: bool = True,
        per_sample_seeds: bool = False,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.num_samples, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.seed, self.repeats, self.shuffle = seed, repeats, shuffle
        self.per_sample_seeds = per_sample_seeds
        self.worker_seed_generator = torch.Generator()
        self.epoch, self.start = 0, 0
        self.set_epoch(0)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Selects the epoch's order; `start` skips this rank's first `start` indices (mid-epoch resume)."""
        self.epoch, self.start = epoch, start
        worker_seed = np.random.SeedSequence([self.seed, epoch, self.rank]).generate_state(1)[0]
        self.worker_seed_generator.manual_seed(int(worker_seed))

    def global_order(self) -> np.ndarray:
        """This epoch's indices for all ranks together (what one process would draw)."""
        n = self.num_samples
        drawn = np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
        return np.repeat(drawn, self.repeats)[:n]

    def __iter__(self):
        per_rank = self.num_samples // self.num_replicas
        mine = self.global_order()[self.rank :: self.num_replicas][:per_rank][self.start :].tolist()
        if not self.per_sample_seeds:
            return iter(mine)
        seeds = (
            np.random.default_rng([self.seed, self.epoch, SAMPLE_SEED_STREAM])
            .integers(0, 2**31, size=self.num_samples)[self.rank :: self.num_replicas][:per_rank][self.start :]
            .tolist()
        )
        return iter(zip(mine, seeds))

    def __len__(self) -> int:
        return max(0, self.num_samples // self.num_replicas - self.start)


SAMPLE_SEED_STREAM = 1  # keeps the per-sample seeds independent of the shuffling stream of (seed, epoch)


@contextmanager
def seeded_rngs(seed: int):
    """Python's, numpy's and torch's global RNGs seeded with `seed` inside the block, restored after it."""
    with _global_rngs_kept():
        _seed_global_rngs(seed)
        yield


@contextmanager
def _global_rngs_kept():
    """Python's, numpy's and torch's global RNG states as they were before the block."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def _seed_global_rngs(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.default_generator.manual_seed(seed)  # the CPU generator the transforms draw from (torch.manual_seed
    # would also seed every accelerator's generators, at a cost per image far above the transform's)


class SeededSamples(Dataset):
    """Loads `dataset[index]` (its transform included) under the per-sample seed of a (index, seed) pair.

    The DataLoader fetches a batch through `__getitems__`: in the main process (workers=0) the global RNGs
    are saved and put back once per batch, not per image (the three states cost about 0.2 ms per save and
    restore); a loader worker's global RNGs serve its samples only, so there is nothing to put back."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]):
        return self.__getitems__([item])[0]

    def __getitems__(self, items: list[tuple[int, int]]) -> list:
        if get_worker_info() is not None:
            return self._load(items)
        with _global_rngs_kept():
            return self._load(items)

    def _load(self, items: list[tuple[int, int]]) -> list:
        samples = []
        for index, seed in items:
            _seed_global_rngs(seed)
            samples.append(self.dataset[index])
        return samples


def _check_loader_args(batch_size: int, workers: int) -> None:
    check_option("batch_size", batch_size)
    check_option("workers", workers)


def build_train_loader(
    dataset,
    batch_size: int,
    workers: int,
    repeated_aug: int = 1,
    seed: int = 0,
    num_replicas: int = 1,
    rank: int = 0,
    worker_init_fn: Callable[[int], None] | None = None,
    pin_memory: bool = True,
) -> DataLoader:
    """Loader over this rank's shard (not to be passed through accelerator.prepare), dropping the
    last partial batch. repeated_aug N > 1 repeats each drawn image N times (DeiT uses 3); 1 is a
    plain seeded shuffle. Call `loader.sampler.set_epoch(epoch)` (or `set_epoch(epoch, start)` to
    resume after `start` samples) before each epoch. Augmentations use per-sample seeds (see
    ShardedSampler), so they are the same for any number of workers and after a mid-epoch resume.

    The workers persist (as timm's loader keeps them): they start once, not every epoch. Each epoch's
    iterator reads the sampler anew, and the per-sample seeds make the workers' own seed irrelevant, so an
    epoch's batches are those of fresh workers."""
    _check_loader_args(batch_size, workers)
    check_option("repeated_aug", repeated_aug)
    sampler = ShardedSampler(len(dataset), num_replicas, rank, seed, repeats=int(repeated_aug), per_sample_seeds=True)
    if len(sampler) < batch_size:
        raise ConfigError(
            f"the training set has {len(dataset)} images, fewer than one global batch of "
            f"{batch_size} x {num_replicas} process(es); lower --batch-size"
        )
    return DataLoader(
        SeededSamples(dataset),
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        drop_last=True,
        pin_memory=pin_memory and torch.cuda.is_available(),  # --pin-mem
        generator=sampler.worker_seed_generator,
        worker_init_fn=worker_init_fn,
        persistent_workers=workers > 0,
    )


def build_stream_loader(
    dataset,
    batch_size: int,
    workers: int,
    drop_last: bool,
    worker_init_fn: Callable[[int], None] | None = None,
    pin_memory: bool = True,
) -> DataLoader:
    """Loader of a stream (timm's reader splits the shards between processes and workers itself). Its
    generator (the workers' base seed, hence the sample shuffle) is reseeded per epoch by `epoch_batches`,
    which reaches the workers only when they start: a stream's workers start every epoch."""
    _check_loader_args(batch_size, workers)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        drop_last=drop_last,
        pin_memory=pin_memory and torch.cuda.is_available(),  # --pin-mem
        worker_init_fn=worker_init_fn,
        generator=torch.Generator().manual_seed(0),
    )


def epoch_batches(loader: DataLoader, epoch: int, first: int, count: int, seed: int = 0, rank: int = 0):
    """The batches first..first+count-1 of `epoch`. A sampled loader starts its sampler there; a stream
    is replayed from the epoch's start (same seeds, same order) and its first batches are dropped, with
    the global RNGs put back afterwards, so that a mid-epoch resume continues exactly in both cases."""
    if isinstance(loader.sampler, ShardedSampler):
        loader.sampler.set_epoch(epoch, start=first * loader.batch_size)
        return islice(loader, count)
    loader.dataset.set_epoch(epoch)
    loader.generator.manual_seed(int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0]))
    batches = iter(loader)
    if first:
        with _global_rngs_kept():
            for _ in islice(batches, first):
                pass
    return islice(batches, count)


def first_images(dataset, count: int) -> torch.Tensor:
    """The first `count` images of a dataset or stream, stacked (the diagnostics' fixed batch)."""
    return torch.stack([image for image, _ in islice(iter(dataset), count)])


def build_eval_loader(
    dataset,
    batch_size: int,
    workers: int,
    worker_init_fn: Callable[[int], None] | None = None,
    pin_memory: bool = True,
) -> DataLoader:
    """Sequential loader over the whole dataset (the engine shards it with accelerator.prepare); its workers
    persist from one evaluation to the next."""
    _check_loader_args(batch_size, workers)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        pin_memory=pin_memory and torch.cuda.is_available(),  # --pin-mem
        worker_init_fn=worker_init_fn,
        persistent_workers=workers > 0,
    )
