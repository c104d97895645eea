"""The one place that uses timm API outside its public namespaces (`timm.models`, `timm.layers`).

`feature_take_indices` resolves `forward_intermediates`' `indices` exactly as timm's own models do
(last-n as an int, negative indices from the end); timm exports it only from `timm.models._features`.
tests/families/test_model_contract.py checks its behavior, so a timm release that moves or changes it fails
there, loudly, rather than inside a model.
"""

from timm.models._features import feature_take_indices

__all__ = ["feature_take_indices"]
