"""A run directory is enough to reuse a run: its ``config.yaml`` says how to rebuild the model and its
data, ``checkpoints/last`` and ``checkpoints/best`` hold the weights.

Every command that takes a run (``train.py --eval-only RUN``, diagnostics, robustness, relative
stability, ensembles) reads it here, so they agree on which options come from the run
(``RUN_KEYS``), on which checkpoint ``--which last|best`` picks, and on how they name it
(``RunCheckpoint.describe``: ``RUN/checkpoints/last (epoch 15)``). Options given explicitly override
the run's. Light to import (no torch): ``train.py --help`` reads nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"  # as convbias.weights.WEIGHTS_FILE (not imported: it loads torch)
WHICH = ("last", "best")
DEFAULT_WHICH = "last"  # the run's final weights: what its final top-1 measured
DEFAULT_KEEP_CHECKPOINTS = 2  # resume points kept: one to fall back to when the newest is damaged
# What a run's config.yaml contributes to a command that reuses the run: the model and how its data is read.
RUN_KEYS = (
    "model",
    "model_kwargs",
    "img_size",
    "num_classes",
    "dataset",
    "data_dir",
    "crop_pct",
    "interpolation",
    "reparametrize",
    "reparametrize_kwargs",
    "output_scale",
)


def is_run_dir(path: str | Path) -> bool:
    """A directory written by train.py: it holds config.yaml (and, once an epoch is done, checkpoints/)."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_run_config(run: str | Path) -> dict[str, Any]:
    """The run's resolved options (its config.yaml); ValueError naming the file when it cannot be read."""
    path = Path(run) / CONFIG_FILE
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{run} is not a run directory: no {CONFIG_FILE} in it") from None
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path} is not a readable run config ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a run config (expected a mapping of option: value)")
    return data


def run_options(run: str | Path) -> dict[str, Any]:
    """The ``RUN_KEYS`` of the run's config.yaml: what a command reusing the run takes as its defaults."""
    config = read_run_config(run)
    return {key: config[key] for key in RUN_KEYS if key in config}


def check_which(which: str) -> str:
    if which not in WHICH:
        raise ValueError(f"--which must be one of {', '.join(WHICH)}, got {which!r}")
    return which


@dataclass(frozen=True)
class RunCheckpoint:
    """One checkpoint of a run: its weights file, which link named it, and the epoch it was written after."""

    run: Path
    which: str
    weights: Path
    epoch: int | None

    def describe(self) -> str:
        epoch = f" (epoch {self.epoch})" if self.epoch is not None else ""
        return f"{self.run / 'checkpoints' / self.which}{epoch}"


def choose_checkpoint(run: str | Path, which: str = DEFAULT_WHICH) -> RunCheckpoint:
    """``checkpoints/<which>`` of a run; ValueError saying what the run holds when it has no such checkpoint."""
    run = Path(run)
    weights = run / "checkpoints" / check_which(which) / WEIGHTS_FILE
    if not weights.is_file():
        held = sorted(p.name for p in (run / "checkpoints").glob("*")) if (run / "checkpoints").is_dir() else []
        raise ValueError(
            f"{run} has no checkpoints/{which}/{WEIGHTS_FILE} (it holds "
            f"{', '.join(held) or 'no checkpoint'}: did the run finish an epoch?)"
        )
    from convbias.weights import weights_metadata  # torch: only once a checkpoint is needed

    epoch = weights_metadata(weights).get("epoch")
    return RunCheckpoint(run, which, weights, int(epoch) if epoch and epoch.isdigit() else None)


def model_spec(run: str | Path, which: str = DEFAULT_WHICH) -> dict[str, Any]:
    """What rebuilding the run's model needs: model, model_kwargs, img_size, in_chans, num_classes, and
    the checkpoint (a RunCheckpoint). Classes and channels come from the checkpoint's metadata, else
    from config.yaml and the dataset's description."""
    from convbias.weights import weights_metadata  # torch and the data sets: only once a model is rebuilt

    from .datasets import DATASETS

    options, checkpoint = run_options(run), choose_checkpoint(run, which)
    metadata = weights_metadata(checkpoint.weights)
    dataset = DATASETS.get(options.get("dataset", ""))
    num_classes = metadata.get("num_classes") or options.get("num_classes")
    in_chans = metadata.get("in_chans") or (dataset.in_chans if dataset else None)
    if num_classes is None or in_chans is None:
        raise ValueError(
            f"{checkpoint.describe()} does not record its number of classes and channels "
            f"(written by an older train.py): pass the model options explicitly"
        )
    img_size = options.get("img_size") or (dataset.default_img_size if dataset else None)
    return {
        "model": options["model"],
        "model_kwargs": dict(options.get("model_kwargs") or {}),
        "img_size": img_size,
        "in_chans": int(in_chans),
        "num_classes": int(num_classes),
        "checkpoint": checkpoint,
    }
