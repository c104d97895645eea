"""The composition root: the model families, and what they contribute to the engine and the tools.

`FAMILIES` names the family packages: the one list of them (the packaging finds every package at the
repository's top, the tests read this tuple); this is the only module that imports them. Each exports a
`FAMILY` record (`convbias.base.family.Family`): its Hub tag, the diagnostics logged during training, its
reparametrizations and the models such runs are exported as, its attention maps of one image, and the tools of
studies of that one family.

`load_families(names=FAMILIES)` imports them (each registers its models in timm's registry) and returns a
`Families`: the engine's `Extensions` (every family's diagnostics and reparametrizations, with the
model-agnostic NTK change and relative stability to diffeomorphisms R_f) that also holds the records, which the
tools ask (`hub_tag`, `export_name`, `query_maps`, `tools`). Registration is an explicit call: the main function
of every console script that builds or reads models calls it once and passes the result down; no other module
imports a family or registers one. A test plugs a family of its own in by name
(`load_families((*FAMILIES, "toy_family"))`, handed to a command's `main(argv, families)`); a new family is its
own package and one name in `FAMILIES` (docs/engine.md, "Adding a model family").
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from convbias.base.errors import ConfigError
from convbias.base.family import Family
from convbias.engine import Extensions

FAMILIES = ("convit", "transformed_cnn", "efcn")  # the family packages, in the order they are asked


@dataclass
class Families(Extensions):
    """The loaded families: what they contribute to training (this is the engine's `Extensions`), and their
    records, {package: FAMILY} in the order they were named, for what the tools ask of a family."""

    records: dict[str, Family] = field(default_factory=dict)

    def tools(self, package: str) -> SimpleNamespace:
        """What a study of that one family calls (the eFCN protocol: the eFCN's measurements and masks)."""
        if package not in self.records:
            raise ConfigError(f"family {package} is not loaded (loaded: {', '.join(self.records) or 'none'})")
        return self.records[package].tools

    def hub_tag(self, package: str) -> str:
        """The Hub tag of the models that `package` registers (a package that is no family tags as itself: timm)."""
        record = self.records.get(package)
        return record.hub_tag if record else package

    def export_name(self, reparametrization: str | None, model_name: str) -> str | None:
        """The registered model a run of `model_name` reparametrized with `reparametrization` is exported as, or
        None when no family names one."""
        for record in self.records.values():
            if reparametrization in record.export_names:
                return record.export_names[reparametrization](model_name)
        return None

    def query_maps(self, model: Any, image: Any, query: Any = None, layers: Any = None) -> Any:
        """The attention maps `convbias-diagnostics --image` draws: (maps, queries, gates) from the first family
        (in the records' order) that has maps of this model. ConfigError for a model none of them has."""
        for record in self.records.values():
            if record.query_maps is not None and (maps := record.query_maps(model, image, query, layers)) is not None:
                return maps
        raise ConfigError(f"{type(model).__name__} has no attention layer with explicit attention maps")


def load_families(names: Sequence[str] = FAMILIES) -> Families:
    """Import the family packages `names` (importing one registers its models in timm's registry) and collect
    what they contribute: the call every console script that builds models makes first, in its main."""
    from convbias.evaluation import stability  # the measurements load torch: not when a command only parses
    from convbias.evaluation.ntk import NTKChange

    records = {package: importlib.import_module(package).FAMILY for package in names}
    diagnostics, reparametrizations = {"ntk": NTKChange()}, {}
    for package, record in records.items():
        _add(diagnostics, record.diagnostics, f"family {package}'s diagnostic")
        _add(reparametrizations, record.reparametrizations, f"family {package}'s reparametrization")
    _add(diagnostics, {"stability": stability.diagnostic}, "the diagnostic")
    initialization = frozenset(name for record in records.values() for name in record.initialization_kwargs)
    return Families(
        diagnostics=diagnostics,
        reparametrizations=reparametrizations,
        initialization_kwargs=initialization,
        records=records,
    )


def _add(known: dict[str, Any], contributed: Any, what: str) -> None:
    """A name given twice would silently replace the first one's function: refused instead."""
    for name in contributed:
        if name in known:
            raise ValueError(f"{what} {name!r}: the name is taken already")
    known.update(contributed)
