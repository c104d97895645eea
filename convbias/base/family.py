"""What a model family offers the tools outside its package, in one record.

A family package (convit, transformed_cnn, efcn) builds one `Family` and exports it as `FAMILY`;
`convbias.families` names the packages and is the only module that imports them, so the training engine,
`convbias-diagnostics` and the Hub export learn about a family from its record and never from its modules.
The record lives in the bottom layer because the families may use only `base` and `gpsa`. No torch here:
`train.py --help` imports this module's users without loading model code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

Diagnostic = Callable[[Any, Any], dict[str, float]]  # (model, images) -> {key: value}; {} for another family's
Reparametrization = Callable[..., Any]  # (model, **kwargs) -> model
# (model, image, query, layers) -> (maps, queries, gates) for convbias-diagnostics --image; None for a model
# this family draws no maps of
QueryMaps = Callable[[Any, Any, Any, Any], Any]


@dataclass(frozen=True)
class Family:
    """One family's contributions; every field but `hub_tag` may be left empty.

    - `hub_tag`: the tag of its models' Hub model cards (beside `image-classification` and `timm`).
    - `diagnostics`: {name: fn(model, images) -> {key: float}}, logged at every evaluation (`--diagnostics`).
    - `reparametrizations`: {name: fn(model, **kwargs) -> model}, for `--reparametrize NAME`.
    - `export_names`: {reparametrization: fn(model name) -> the registered model a run reparametrized that way
      is exported as}; that model takes the reparametrization's options as its keyword arguments.
    - `query_maps`: the attention maps `convbias-diagnostics --image` draws (see `QueryMaps`).
    - `tools`: what a study of this one family calls (the eFCN protocol's measurements and masks).
    - `initialization_kwargs`: model kwargs that only say where the initial weights come from (an eFCN's
      `cnn_checkpoint`, a file read when the model is built); trained weights replace them, so a run's model is
      rebuilt without them and an export leaves them out (a path of the machine that trained it).
    """

    hub_tag: str
    diagnostics: Mapping[str, Diagnostic] = field(default_factory=dict)
    reparametrizations: Mapping[str, Reparametrization] = field(default_factory=dict)
    export_names: Mapping[str, Callable[[str], str]] = field(default_factory=dict)
    query_maps: QueryMaps | None = None
    tools: SimpleNamespace = field(default_factory=SimpleNamespace)
    initialization_kwargs: tuple[str, ...] = ()
