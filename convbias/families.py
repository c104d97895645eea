"""The composition root: the model families, and what they contribute to the engine and the tools.

`FAMILIES` names the family packages; this is the only module that imports them. Each exports a `FAMILY`
record (`convbias.base.family.Family`): its Hub tag, the diagnostics logged during training, its
reparametrizations and the models such runs are exported as, its attention maps of one image, and the
tools of studies of that one family. `load_families()` imports them (each registers its models in timm's
registry) and returns the engine's `Extensions`: every family's diagnostics and reparametrizations, with the
model-agnostic NTK change and relative stability to diffeomorphisms R_f. Every command that builds models
calls it first; `convbias-diagnostics` and the Hub export ask the functions below for the rest, so a new
family is its own package and one name in `FAMILIES` (docs/engine.md, "Adding a model family").
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

from convbias.base.errors import ConfigError
from convbias.base.family import Family
from convbias.engine import Extensions

FAMILIES = ("convit", "transformed_cnn", "efcn")  # the family packages, in the order they are asked


def families() -> dict[str, Family]:
    """{package: its record}. Imported here, when a command asks, not at the top: importing a family
    registers its models (`train.py --help` registers nothing and loads no model code)."""
    return {package: importlib.import_module(package).FAMILY for package in FAMILIES}


def family_tools(package: str) -> SimpleNamespace:
    """What a study of that one family calls (the eFCN protocol: the eFCN's measurements and masks)."""
    return families()[package].tools


def load_families() -> Extensions:
    """Register every family's models in timm and collect what they contribute to training."""
    from convbias.evaluation import stability
    from convbias.evaluation.ntk import NTKChange

    diagnostics, reparametrizations = {"ntk": NTKChange()}, {}
    for package, record in families().items():
        _add(diagnostics, record.diagnostics, f"family {package}'s diagnostic")
        _add(reparametrizations, record.reparametrizations, f"family {package}'s reparametrization")
    _add(diagnostics, {"stability": stability.diagnostic}, "the diagnostic")
    return Extensions(
        diagnostics=diagnostics, reparametrizations=reparametrizations, initialization_kwargs=initialization_kwargs()
    )


def initialization_kwargs() -> frozenset[str]:
    """The model kwargs that only say where initial weights come from, of every family (`Family`)."""
    return frozenset(name for record in families().values() for name in record.initialization_kwargs)


def _add(known: dict[str, Any], contributed: Any, what: str) -> None:
    """A name given twice would silently replace the first one's function: refused instead."""
    for name in contributed:
        if name in known:
            raise ValueError(f"{what} {name!r}: the name is taken already")
    known.update(contributed)


def hub_tag(package: str) -> str:
    """The Hub tag of the models that `package` registers (a package that is no family tags as itself: timm)."""
    record = families().get(package)
    return record.hub_tag if record else package


def export_name(reparametrization: str | None, model_name: str) -> str | None:
    """The registered model a run of `model_name` reparametrized with `reparametrization` is exported as, or
    None when no family names one."""
    for record in families().values():
        if reparametrization in record.export_names:
            return record.export_names[reparametrization](model_name)
    return None


def query_maps(model: Any, image: Any, query: Any = None, layers: Any = None) -> Any:
    """The attention maps `convbias-diagnostics --image` draws: (maps, queries, gates) from the first family
    (in `FAMILIES`' order) that has maps of this model. ConfigError for a model none of them has."""
    for record in families().values():
        if record.query_maps is not None and (maps := record.query_maps(model, image, query, layers)) is not None:
            return maps
    raise ConfigError(f"{type(model).__name__} has no attention layer with explicit attention maps")
