"""Streamed datasets through timm's dataset factory: webdataset tar shards (``--dataset wds/NAME``).

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
drops them. Hugging Face datasets (``hfds/``) are not wired: they need the ``datasets`` package
(pyarrow), which this project does not install.
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import yaml

STREAM_PREFIXES = ("wds/",)
INFO_FILES = ("_info.json", "info.json")
SPLITS = ("train", "validation")
STREAM_LAYOUT = ("DIR/_info.json ({'num_classes': K, 'splits': {'train': {'num_samples', 'filenames', "
                 "'shard_lengths', 'name'}, 'validation': {...}}}) and the tar shards it lists "
                 "(samples <key>.jpg|png|webp + <key>.cls)")


def is_stream(name: str) -> bool:
    return isinstance(name, str) and name.startswith(STREAM_PREFIXES)


def check_stream(name: str, data_dir: str | None, train_fraction: float, num_classes: int | None) -> dict[str, Any]:
    """The info of a shard set after cheap checks (ValueError, one line): package, layout, every shard."""
    if not is_stream(name) or not name.partition("/")[2]:
        raise ValueError(f"--dataset {name}: expected wds/NAME (NAME: any label for the shard set)")
    try:
        import webdataset  # noqa: F401
    except ImportError:
        raise ValueError(f"--dataset {name} needs the webdataset package: pip install 'webdataset>=0.2'") from None
    if float(train_fraction) < 1.0 or num_classes is not None:
        raise ValueError(f"--dataset {name}: --train-fraction and --num-classes need an index of labels, which a "
                         f"stream has not; write the subset's shards instead")
    if not data_dir or not Path(data_dir).is_dir():
        raise ValueError(f"--dataset {name} needs --data-dir with {STREAM_LAYOUT}")
    root = Path(data_dir)
    info_file = next((root / n for n in INFO_FILES if (root / n).is_file()), None)
    if info_file is None:
        raise ValueError(f"--data-dir {root}: no {' or '.join(INFO_FILES)}; expected {STREAM_LAYOUT}")
    try:
        info = json.loads(info_file.read_text()) if info_file.suffix == ".json" else yaml.safe_load(info_file.read_text())
        splits = {split: info["splits"][split] for split in SPLITS}
        counts = {split: int(splits[split]["num_samples"]) for split in SPLITS}
        files = {split: [root / f for f in splits[split]["filenames"]] for split in SPLITS}
        int(info["num_classes"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{info_file}: missing or malformed {e}; expected {STREAM_LAYOUT}") from None
    for split in SPLITS:
        for shard in files[split]:
            _check_shard(shard)
    return {"num_classes": int(info["num_classes"]), "num_samples": counts}


def _check_shard(path: Path) -> None:
    """A local shard must exist and be a complete tar (its index readable to the end)."""
    if "://" in str(path):  # remote shards are checked by the reader as they stream
        return
    if not path.is_file():
        raise ValueError(f"shard {path} listed in the info file does not exist")
    try:
        with tarfile.open(path) as tar:
            tar.getmembers()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ValueError(f"shard {path} is corrupt or partial ({e}); rewrite or remove it (and its info entry)") from None


def create_streams(name: str, data_dir: str, seed: int, batch_size: int) -> tuple[Any, Any]:
    """(train, val) IterableImageDatasets from timm's factory; transforms are set by the caller."""
    from timm.data import create_dataset

    common = dict(root=str(data_dir), batch_size=batch_size, seed=seed)
    train = create_dataset(name, split="train", is_training=True, **common)
    val = create_dataset(name, split="validation", is_training=False, **common)
    return train, val
