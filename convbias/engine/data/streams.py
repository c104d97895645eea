"""Datasets through timm's dataset factory: webdataset tar shards (``--dataset wds/NAME``, streamed),
streamed Hugging Face datasets (``--dataset hfids/NAME``) and Hugging Face datasets with random access
(``--dataset hfds/NAME``).

ImageNet as tar shards (local, or anything ``webdataset`` opens) trains without unpacking: timm's
``ReaderWds`` splits the shards between processes and loader workers and shuffles shards and samples
with seeds of (seed, epoch). ``--data-dir`` holds the shards and timm's ``_info.json`` (or ``info.json``)::

    {"num_classes": 1000,
     "splits": {"train": {"name": "train", "num_samples": 1281167, "filenames": ["imagenet-train-0000.tar", ...],
                          "shard_lengths": [1251, ...]},
                "validation": {...}}}

each sample a ``<key>.jpg`` (or .png/.webp) with a ``<key>.cls`` label. Before any work every listed
local shard is opened and its index read, so a missing, corrupt or partial shard stops the run with one
line naming it (timm's reader would log it and skip it, silently training on less data).

Not available on a stream: per-class subsampling (``--train-fraction``, ``--num-classes``): a stream has
no index of labels to draw from; write the subset's shards instead. The validation stream is read whole
by every evaluation. A mid-epoch resume re-reads the epoch's first batches (same seeds, same order) and
drops them.

``hfids/NAME`` streams a Hugging Face dataset through timm's ``ReaderHfids`` (``datasets``' streaming
mode: nothing is downloaded or prepared first; shards go to processes with ``split_dataset_by_node``, samples
are shuffled in a buffer seeded by (seed, epoch)). NAME is a Hub id or a local dataset directory, DIR the
datasets cache. A stream's length must be known before it is read (the schedule needs steps per epoch), so
the dataset card must give each split's ``num_examples`` (Hub datasets' cards do; for a local directory,
``dataset_info.splits`` in its README.md), and its classes come from the ClassLabel ``label`` feature.
The same limits as ``wds/`` apply (no subsampling, replay on a mid-epoch resume).

``hfds/NAME`` goes through timm's ``ReaderHfds``, which calls ``datasets.load_dataset(NAME, split=...,
cache_dir=--data-dir)``: NAME is a Hub dataset id or a local dataset directory (parquet, imagefolder, ...;
read offline), DIR the cache the dataset is downloaded and prepared into. The split is random access, so
it takes the engine's sampled loaders (exact resume) and ``--train-fraction`` / ``--num-classes``
(``HfdsImages``: labels read without decoding images). Any failure to load (no ``datasets`` package, an
unknown or unreachable NAME, a corrupt file) is one ConfigError line, quoting the file the library logged.

``datasets`` is imported inside functions: it is an optional dependency (the ``streams`` extra).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
import tarfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from timm.data import create_dataset
from torch.utils.data import Dataset

from convbias.base.errors import ConfigError
from convbias.base.inputs import read_json

WDS_PREFIX, HFIDS_PREFIX, HFDS_PREFIX = "wds/", "hfids/", "hfds/"
STREAM_PREFIXES = (WDS_PREFIX, HFIDS_PREFIX)
HFDS_VAL_SPLITS = ("validation", "test")  # evaluated on the first of these the dataset has
HFDS_LAYOUT = (
    "NAME: a Hugging Face Hub dataset id or a local dataset directory that datasets.load_dataset "
    "reads (parquet, imagefolder, ...), with 'image' and 'label' columns and 'train' and 'validation' "
    "(or 'test') splits; DIR: the datasets cache it is downloaded and prepared into"
)
HFIDS_LAYOUT = (
    "NAME: a Hugging Face Hub dataset id or a local dataset directory that datasets streams, whose "
    "card gives the 'train' and 'validation' (or 'test') splits' num_examples and an 'image' column "
    "and a ClassLabel 'label' column; DIR: the datasets cache"
)
INFO_FILES = ("_info.json", "info.json")
SPLITS = ("train", "validation")
STREAM_LAYOUT = (
    "DIR/_info.json ({'num_classes': K, 'splits': {'train': {'num_samples', 'filenames', "
    "'shard_lengths', 'name'}, 'validation': {...}}}) and the tar shards it lists "
    "(samples <key>.jpg|png|webp + <key>.cls)"
)


@dataclass(frozen=True)
class Columns:
    """A Hugging Face dataset's image and label columns (--input-key, --target-key; None: timm's)."""

    input_key: str | None = None
    target_key: str | None = None

    @property
    def image(self) -> str:
        return self.input_key or "image"

    @property
    def target(self) -> str:
        return self.target_key or "label"

    def reader_keys(self) -> dict[str, str]:
        """The keys given, as timm's create_dataset takes them."""
        return {key: value for key, value in vars(self).items() if value is not None}

    def hint(self) -> str:
        return "; --input-key and --target-key name other columns" if not self.reader_keys() else ""


TIMM_COLUMNS = Columns()  # 'image' and 'label'


def is_stream(name: str) -> bool:
    return isinstance(name, str) and name.startswith(STREAM_PREFIXES)


def is_hfds(name: str) -> bool:
    return isinstance(name, str) and name.startswith(HFDS_PREFIX)


def is_factory_source(name: str) -> bool:
    """A --dataset read through timm's dataset factory (wds/ or hfds/) rather than engine.data.datasets."""
    return is_stream(name) or is_hfds(name)


def factory_layout(name: str) -> str:
    """The layout a wds/, hfids/ or hfds/ source expects, for error messages."""
    return HFIDS_LAYOUT if name.startswith(HFIDS_PREFIX) else HFDS_LAYOUT if is_hfds(name) else STREAM_LAYOUT


def check_stream(
    name: str,
    data_dir: str | None,
    train_fraction: float,
    first_classes: int | None,
    workers: int = 0,
    processes: int = 1,
    train_num_samples: int | None = None,
    columns: Columns = TIMM_COLUMNS,
) -> dict[str, Any]:
    """What a wds/ or hfids/ stream holds (num_classes, classes, num_samples and split names per split) after
    cheap checks (ConfigError, one line): package, layout, split sizes, every local shard, and enough training
    shards for `processes` x `workers` loader workers. `train_num_samples` (--train-num-samples) is the train
    epoch's length in place of the split's size, as timm's readers take it (an hfids/ card then need not give
    the train split's size). `columns`: an hfids/ dataset's image and label columns."""
    if not is_stream(name) or not name.partition("/")[2]:
        raise ConfigError(f"--dataset {name}: expected wds/NAME (NAME: any label for the shard set) or hfids/NAME")
    package, pip_name = (
        ("datasets", "datasets") if name.startswith(HFIDS_PREFIX) else ("webdataset", "'webdataset>=0.2'")
    )
    try:
        __import__(package)
    except ImportError:
        raise ConfigError(f"--dataset {name} needs the {package} package: pip install {pip_name}") from None
    if float(train_fraction) < 1.0 or first_classes is not None:
        raise ConfigError(
            f"--dataset {name}: --train-fraction and --first-classes need an index of labels, which a "
            f"stream has not; write the subset's shards instead"
        )
    if not data_dir or not Path(data_dir).is_dir():
        raise ConfigError(f"--dataset {name} needs --data-dir with {factory_layout(name)}")
    if name.startswith(HFIDS_PREFIX):
        info = _check_hfids(name, data_dir, train_num_samples, columns)
    else:
        info = _check_wds(Path(data_dir))
    if train_num_samples:
        info["num_samples"]["train"] = int(train_num_samples)
    check_shards_per_worker(name, info["train_shards"], workers, processes)
    return info


def check_shards_per_worker(name: str, shards: int, workers: int, processes: int) -> None:
    """timm's readers hand whole training shards to loader workers: a worker without one reads nothing (wds/:
    the epoch silently ends early; hfids/: timm raises in the worker mid-run). ReaderWds deals the shards out
    to every worker of every process; datasets' split_dataset_by_node gives each process shards / processes
    when that divides, else every shard (each process then keeps every processes-th example)."""
    if name.startswith(HFIDS_PREFIX):
        fits = shards // processes if shards % processes == 0 else shards  # workers per process with a shard
    else:
        fits = shards // processes
    if fits < max(1, workers):
        hint = f"use --workers {fits} or fewer" if fits else f"write at least {processes} shards, one per process"
        raise ConfigError(
            f"--workers {workers}: the training stream of --dataset {name} has {shards} shard(s) for "
            f"{processes} process(es) x {max(1, workers)} loader worker(s), and a worker without a "
            f"shard reads nothing; {hint}"
        )


def _check_wds(root: Path) -> dict[str, Any]:
    """timm's info file of a shard set, and every local shard it lists."""
    info_file = next((root / n for n in INFO_FILES if (root / n).is_file()), None)
    if info_file is None:
        raise ConfigError(f"--data-dir {root}: no {' or '.join(INFO_FILES)}; expected {STREAM_LAYOUT}")
    info = read_json(info_file, "shard set info")
    try:
        splits = {split: info["splits"][split] for split in SPLITS}
        counts = {split: int(splits[split]["num_samples"]) for split in SPLITS}
        files = {split: [root / f for f in splits[split]["filenames"]] for split in SPLITS}
        num_classes = int(info["num_classes"])
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise ConfigError(f"{info_file}: missing or malformed {e}; expected {STREAM_LAYOUT}") from None
    for split in SPLITS:
        for shard in files[split]:
            _check_shard(shard)
    return {
        "num_classes": num_classes,
        "classes": [str(k) for k in range(num_classes)],
        "num_samples": counts,
        "splits": {split: split for split in SPLITS},
        "train_shards": len(files["train"]),
    }


def _check_hfids(name: str, data_dir: str, train_num_samples: int | None, columns: Columns) -> dict[str, Any]:
    """The card of a streamed Hugging Face dataset (read, not the data): split sizes (the train split's not needed
    with `train_num_samples`), image and label columns."""
    import datasets  # an optional dependency (the streams extra)

    with _one_line_errors(name, data_dir, HFIDS_LAYOUT):
        builder = datasets.load_dataset_builder(name.partition("/")[2], cache_dir=str(data_dir))
        info = builder.info
        listed = "train" in (info.splits or {}) or bool(train_num_samples)  # else the size check below says so
        train_shards = builder.as_streaming_dataset(split="train").num_shards if listed else 0
    splits, features = info.splits or {}, info.features or {}
    val_split = next((split for split in HFDS_VAL_SPLITS if split in splits), HFDS_VAL_SPLITS[0])
    sizes = {split: getattr(splits.get(split), "num_examples", 0) or 0 for split in ("train", val_split)}
    unknown = [split for split, size in sizes.items() if not size and not (split == "train" and train_num_samples)]
    if unknown:
        hint = ", or --train-num-samples for 'train'" if "train" in unknown else ""
        raise ConfigError(
            f"--dataset {name}: its card gives no num_examples for split {' and '.join(map(repr, unknown))} "
            f"(a stream's length is needed before it is read); expected {HFIDS_LAYOUT}{hint}"
        )
    classes = getattr(features.get(columns.target), "names", None)
    if columns.image not in features or not classes:
        raise ConfigError(
            f"--dataset {name}: its card has no {columns.image!r} column or no ClassLabel {columns.target!r} column "
            f"(columns: {', '.join(features) or 'none'}); expected {HFIDS_LAYOUT}{columns.hint()}"
        )
    return {
        "num_classes": len(classes),
        "classes": list(classes),
        "num_samples": dict(zip(SPLITS, sizes.values())),
        "splits": dict(zip(SPLITS, sizes)),
        "train_shards": train_shards,
    }


def _check_shard(path: Path) -> None:
    """A local shard must exist and be a complete tar (its index readable to the end)."""
    if "://" in str(path):  # remote shards are checked by the reader as they stream
        return
    if not path.is_file():
        raise ConfigError(f"shard {path} listed in the info file does not exist")
    try:
        with tarfile.open(path) as tar:
            tar.getmembers()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ConfigError(
            f"shard {path} is corrupt or partial ({e}); rewrite or remove it (and its info entry)"
        ) from None


def create_streams(
    name: str,
    data_dir: str,
    seed: int,
    batch_size: int,
    splits: dict[str, str] | None = None,
    train_num_samples: int | None = None,
    columns: Columns = TIMM_COLUMNS,
) -> tuple[Any, Any]:
    """(train, val) IterableImageDatasets from timm's factory (`splits`: the dataset's name of each of SPLITS,
    as `check_stream` found them); transforms are set by the caller. `train_num_samples` (None: the split's size)
    is the train epoch's length, as timm's train.py gives create_dataset: the reader's len() and what it yields
    per epoch (the shards are cycled when it exceeds the split). `columns`: an hfids/ dataset's, as timm's
    input_key and target_key."""
    splits = splits or {split: split for split in SPLITS}
    common = dict(root=str(data_dir), batch_size=batch_size, seed=seed, **columns.reader_keys())
    train = create_dataset(name, split=splits["train"], is_training=True, num_samples=train_num_samples, **common)
    val = create_dataset(name, split=splits["validation"], is_training=False, **common)
    return train, val


class HfdsImages(Dataset):
    """A split of a Hugging Face dataset as timm's ImageDataset reads it (PIL images, int labels), with the
    interface of engine.data.datasets (`targets`, `classes`, settable `transform`, `subset`), so that the class
    subset and per-class fraction code applies unchanged."""

    def __init__(self, images: Dataset, classes: Sequence[str], indices: np.ndarray | None = None):
        self.images = images  # timm's ImageDataset (transform None: this wrapper applies its own)
        self.classes = list(classes)
        self.indices = np.arange(len(images)) if indices is None else indices
        self.transform = None

    @cached_property
    def targets(self) -> list[int]:
        """Labels in order, read without decoding any image (only subsampling asks for them)."""
        return [int(t) for t in self.images.reader.iter_targets()]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        image, target = self.images[int(self.indices[index])]
        return (self.transform(image) if self.transform is not None else image), target

    def subset(self, indices: Sequence[int], num_classes: int | None = None) -> HfdsImages:
        indices = np.asarray(indices, dtype=np.int64)
        subset = HfdsImages(
            self.images, self.classes[:num_classes] if num_classes else self.classes, self.indices[indices]
        )
        subset.transform, subset.targets = self.transform, [self.targets[i] for i in indices]
        return subset


@contextmanager
def _held_logs(*logger_names: str) -> Iterator[list[logging.LogRecord]]:
    """Holds back what libraries log inside the block: printed after it when it succeeds, dropped when it
    fails (the caller's one error line quotes it: `datasets` logs the corrupt file's name, not its exception;
    huggingface_hub logs one warning per retry when the Hub cannot be reached)."""
    loggers = [logging.getLogger(name) for name in logger_names]
    held = logging.handlers.MemoryHandler(sys.maxsize, logging.CRITICAL + 1)
    own = [(logger.handlers, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.handlers, logger.propagate = [held], False
    try:
        yield held.buffer
    finally:
        for logger, (handlers, propagate) in zip(loggers, own):
            logger.handlers, logger.propagate = handlers, propagate
    for record in held.buffer:
        logging.getLogger(record.name).handle(record)


@contextmanager
def _one_line_errors(name: str, data_dir: str, layout: str) -> Iterator[None]:
    """Any failure of `datasets` inside the block (no such dataset, offline, a corrupt file, a missing column:
    it raises many kinds) as one ConfigError line, quoting the file it logged; its logs held back meanwhile."""
    with _held_logs("datasets", "huggingface_hub") as logged:
        try:
            yield
        except Exception as error:
            reason = f"{type(error).__name__}: {error}"
            errors = [record.getMessage() for record in logged if record.levelno >= logging.ERROR]
            reason = errors[-1] if errors and str(error) in errors[-1] else reason  # the logged one names the file
            if isinstance(error, ConnectionError) and not os.environ.get("HF_HUB_OFFLINE"):
                reason += " (no network? HF_HUB_OFFLINE=1 reads the datasets cache in --data-dir without retries)"
            raise ConfigError(f"--dataset {name} (--data-dir {data_dir}): {reason}; expected {layout}") from None


def _check_columns(reader: Any) -> None:
    """A missing image or label column is an error now, not at the first batch: timm's reader casts the image
    column (which adds a missing one, empty, in datasets 5) and reads labels only when asked."""
    row = reader.dataset[0]
    for key in (reader.image_key, reader.label_key):
        if row.get(key) is None:
            others = ", ".join(column for column in row if column != reader.image_key)
            raise ConfigError(
                f"split {reader.split!r} has no {key!r} column or an empty one (other columns: {others}); "
                "--input-key and --target-key name the image and label columns"
            )


def load_hfds(name: str, data_dir: str, columns: Columns = TIMM_COLUMNS) -> tuple[HfdsImages, HfdsImages]:
    """(train, validation or test) of a Hugging Face dataset through timm's factory (ReaderHfds: NAME is
    datasets.load_dataset's path, DIR its cache_dir; `columns` its input_key and target_key); any failure is a
    ConfigError of one line."""
    if not is_hfds(name) or not name.partition("/")[2]:
        raise ConfigError(f"--dataset {name}: expected hfds/NAME; {HFDS_LAYOUT}")
    try:
        import datasets  # noqa: F401  (an optional dependency: the streams extra)
    except ImportError:
        raise ConfigError(f"--dataset {name} needs the datasets package: pip install datasets") from None
    keys = columns.reader_keys()
    with _one_line_errors(name, data_dir, HFDS_LAYOUT + columns.hint()):
        train = create_dataset(name, root=str(data_dir), split="train", **keys)
        splits = train.reader.dataset.info.splits or {}
        val_split = next((split for split in HFDS_VAL_SPLITS if split in splits), HFDS_VAL_SPLITS[0])
        val = create_dataset(name, root=str(data_dir), split=val_split, **keys)
        for split_set in (train, val):
            _check_columns(split_set.reader)
    classes = sorted(train.reader.class_to_idx, key=train.reader.class_to_idx.get)
    train = HfdsImages(train, classes)
    if not classes:  # labels without a ClassLabel feature: classes 0..max
        train.classes = classes = [str(k) for k in range(max(train.targets, default=-1) + 1)]
    return train, HfdsImages(val, classes)
