"""The data package's checks of a run's options, before any work starts: the --dataset source, and the input
format and class map as the data factory resolves them (engine.data.factory)."""

from __future__ import annotations

from convbias.base.errors import ConfigError

from ..config.options import DATASETS, Config
from .factory import class_map, input_format
from .streams import is_factory_source


def check(cfg: Config) -> None:
    """ConfigError naming the option when --dataset names no source, or --mean/--std/--input-size or
    --class-map do not fit the data set."""
    if cfg.dataset not in DATASETS and not is_factory_source(cfg.dataset):
        raise ConfigError(
            f"unknown dataset '{cfg.dataset}'; choices: {', '.join(DATASETS)}, wds/NAME (tar shards), "
            f"hfids/NAME (Hugging Face datasets, streamed) or hfds/NAME (Hugging Face datasets)"
        )
    input_format(cfg)
    class_map(cfg)
