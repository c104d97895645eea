"""What the composition root hands the engine: the engine itself names no model family.

`convbias.families` (called by `train.py`) imports the families, which register their models in timm's
registry, and fills an `Extensions` with what their records (`convbias.base.family.Family`) contribute to
training:

- `diagnostics`: {name: fn(model, images) -> {key: float}}, called on a fixed batch of evaluation images
  at every evaluation (`--diagnostics`); a function returns {} for a model it does not apply to.
- `reparametrizations`: {name: fn(model, **kwargs) -> model}, a change of architecture during training
  (`--reparametrize NAME --reparametrize-at-epoch E`): the engine swaps the model and keeps the optimizer
  state of every parameter that survives (same name and shape).
- `initialization_kwargs`: model kwargs that only say where a model's initial weights come from (a file read
  when it is built): a run's model rebuilt around its checkpoint's weights is built without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from convbias.base.family import Diagnostic, Reparametrization  # no torch there: `train.py --help` stays light


@dataclass
class Extensions:
    diagnostics: dict[str, Diagnostic] = field(default_factory=dict)
    reparametrizations: dict[str, Reparametrization] = field(default_factory=dict)
    initialization_kwargs: frozenset[str] = frozenset()
