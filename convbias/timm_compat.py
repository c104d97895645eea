"""The one place that uses timm API outside its public namespaces (`timm.models`, `timm.layers`).

`FeatureGetterNet` is the wrapper timm's builder puts around a model for `features_only=True,
feature_cls='getter'` (it calls `forward_intermediates`); timm exports it only from
`timm.models._features`, and the T-CNN entries, which build their feature wrapper themselves, need it.

`feature_take_indices` resolves `forward_intermediates`' `indices` exactly as timm's own models do
(last-n as an int, negative indices from the end); timm exports it only from `timm.models._features`.
tests/test_model_contract.py checks its behavior, so a timm release that moves or changes it fails
there, loudly, rather than inside a model.
"""

from timm.models._features import FeatureGetterNet, feature_take_indices

__all__ = ["FeatureGetterNet", "feature_take_indices"]
