"""timm registry entries `tcnn_<resnet>`: a timm ResNet built (and loaded) by timm, then transformed.

    timm.create_model('tcnn_resnetrs50', pretrained=True, pretrained_cfg_overlay=dict(file='rs50.pth'))

`pretrained=True` loads timm's weights of the CNN through timm's own loading code (from the hub, or
offline from `pretrained_cfg_overlay=dict(file=PATH)`), including its classifier reset when
`num_classes` differs from the checkpoint's. A pretrained tag selects the CNN's weights:
`tcnn_resnet50.a1_in1k`. The transform options (`stages`, `init`, `keep_stride`,
`locality_strength`, `gating`) are model kwargs; every other kwarg goes to the CNN
(`num_classes`, `drop_path_rate`, ...). The model keeps the CNN's `pretrained_cfg` (mean, std,
input size of the weights it was loaded from).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re

import timm
from timm.models import (
    FeatureDictNet,
    FeatureHookNet,
    FeatureListNet,
    generate_default_cfgs,
    get_pretrained_cfg,
    register_model,
)
from torch import nn

from convbias.weights import check_compatible, read_state_dict

from .transform import transform

TRANSFORM_KWARGS = [name for name in inspect.signature(transform).parameters if name != "cnn"]


def _cnn_names() -> list[str]:
    """timm's plain ResNets: resnet<depth>[letter] (ResNet-B/C/D/S/T) and resnetrs<depth>."""
    return [name for name in timm.list_models(module="resnet") if re.fullmatch(r"resnet(rs)?\d+[a-z]?", name)]


def _check_pretrained_file(overlay: dict | None) -> None:
    path = (overlay or {}).get("file")
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"pretrained file {path!r} does not exist")


FEATURE_CLASSES = {"list": FeatureListNet, "dict": FeatureDictNet, "hook": FeatureHookNet}


def _feature_wrapper(model: nn.Module, out_indices, feature_cls) -> nn.Module:
    """timm's features_only wrapper around the transformed model (its feature_info has the new reductions)."""
    feature_cls = feature_cls or "list"
    if feature_cls not in FEATURE_CLASSES:
        raise ValueError(f"feature_cls={feature_cls!r}: a T-CNN supports feature_cls in {sorted(FEATURE_CLASSES)}")
    features = FEATURE_CLASSES[feature_cls](model, out_indices=out_indices)
    features.pretrained_cfg = features.default_cfg = model.pretrained_cfg  # as timm's builder does
    return features


def _update_cfg(model: nn.Module) -> None:
    """The CNN's pretrained cfg with the pool size of the transformed model (a removed stride doubles it)."""
    cfg = dict(model.pretrained_cfg)
    reduction = model.feature_info[-1]["reduction"]
    cfg["pool_size"] = tuple(side // reduction for side in cfg["input_size"][1:])
    cfg["architecture"] = f"tcnn_{cfg.get('architecture', '')}"
    model.pretrained_cfg = model.default_cfg = cfg


def create_tcnn(cnn_name: str, pretrained: bool = False, **kwargs) -> nn.Module:
    """Build timm's `cnn_name` (with its pretrained weights if asked) and transform it; with
    `features_only=True` the transformed model goes into timm's feature wrapper (not the CNN)."""
    transform_kwargs = {name: kwargs.pop(name) for name in TRANSFORM_KWARGS if name in kwargs}
    features_only = kwargs.pop("features_only", False)
    out_indices = kwargs.pop("out_indices", (0, 1, 2, 3, 4))
    feature_cls = kwargs.pop("feature_cls", None)
    pretrained_cfg = kwargs.pop("pretrained_cfg", None)
    overlay = kwargs.pop("pretrained_cfg_overlay", None)
    if pretrained:
        _check_pretrained_file(overlay)
    try:
        cnn = timm.create_model(
            cnn_name, pretrained=pretrained, pretrained_cfg=pretrained_cfg, pretrained_cfg_overlay=overlay, **kwargs
        )
    except RuntimeError as error:
        if not str(error).startswith("Error(s) in loading state_dict") or "file" not in (overlay or {}):
            raise
        try:
            check_compatible(timm.create_model(cnn_name, **kwargs), read_state_dict(overlay["file"]), overlay["file"])
        except ValueError as mismatch:
            raise ValueError(f"{mismatch} (the CNN {cnn_name} of tcnn_{cnn_name})") from None
        raise
    model = transform(cnn, **transform_kwargs)
    _update_cfg(model)
    return _feature_wrapper(model, out_indices, feature_cls) if features_only else model


def _default_cfg(cnn_name: str) -> dict:
    """Registered cfg of tcnn_<cnn>: the CNN's, with the pool size of the default transform (last stage
    at stride 1: twice the CNN's), no weights of its own (pretrained=True loads the CNN's)."""
    cfg = dataclasses.asdict(get_pretrained_cfg(cnn_name))
    cfg.update(url="", hf_hub_id=None, tag=None, architecture=None, pool_size=tuple(2 * p for p in cfg["pool_size"]))
    return {k: v for k, v in cfg.items() if v is not None}


def _make_entrypoint(cnn_name: str):
    def entrypoint(pretrained: bool = False, **kwargs) -> nn.Module:
        return create_tcnn(cnn_name, pretrained=pretrained, **kwargs)

    entrypoint.__name__ = entrypoint.__qualname__ = f"tcnn_{cnn_name}"
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = f"Transformed {cnn_name}: timm's {cnn_name} with its last stage's 3x3 convs as GPSA layers."
    return entrypoint


default_cfgs = generate_default_cfgs({f"tcnn_{name}": _default_cfg(name) for name in _cnn_names()})

for _cnn_name in _cnn_names():
    globals()[f"tcnn_{_cnn_name}"] = register_model(_make_entrypoint(_cnn_name))
