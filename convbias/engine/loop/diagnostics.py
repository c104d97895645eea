"""Per-evaluation model diagnostics: the functions the composition root registers (`Extensions.diagnostics`).

Each `fn(model, images)` returns {} for a model it does not apply to. A function that raises is
reported once and then left out, so a diagnostics bug does not stop a long training run.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from .extensions import Diagnostic


class ModelDiagnostics:
    """Calls every registered ``fn(model, images)`` on a fixed batch of eval images."""

    def __init__(self, images: torch.Tensor, summaries: Mapping[str, Diagnostic]):
        self.images = images
        self.summaries = dict(summaries)
        self.errors: dict[str, str] = {}

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        results: dict[str, float] = {}
        for name, summary in list(self.summaries.items()):
            try:
                results.update({key: float(value) for key, value in summary(model, self.images).items()})
            except Exception as e:  # see module docstring: report once, keep training
                self.errors[name] = f"{type(e).__name__}: {e}"
                del self.summaries[name]
                warnings.warn(
                    f"diagnostics {name!r} failed and is disabled for this run: {self.errors[name]}", stacklevel=2
                )
        model.train(was_training)
        return results
