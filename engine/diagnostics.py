"""Model diagnostics logged every evaluation: dispatch to each family's ``<family>.diagnostics.summary``.

``convit.diagnostics.summary`` (nonlocality, gating, attention span of GPSA/MHSA layers, T-CNN layers
too) and ``efcn.diagnostics.summary`` (deviation from locality) each return ``{}`` for a model they do
not apply to. A family whose diagnostics module is not installed is skipped, so the engine runs before
(and without) them. A diagnostics function that raises is reported once and then left out, so a
diagnostics bug does not stop a long training run.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Callable

import torch

FAMILIES = ("convit", "efcn")


def _load_summaries() -> dict[str, Callable]:
    summaries = {}
    for family in FAMILIES:
        name = f"{family}.diagnostics"
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name in (family, name):
                continue
            raise
        if hasattr(module, "summary"):
            summaries[name] = module.summary
    return summaries


class ModelDiagnostics:
    """Calls every available ``summary(model, images)`` on a fixed batch of eval images."""

    def __init__(self, images: torch.Tensor):
        self.images = images
        self.summaries = _load_summaries()
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
                warnings.warn(f"{name}.summary failed and is disabled for this run: {self.errors[name]}")
        model.train(was_training)
        return results
