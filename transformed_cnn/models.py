"""timm registry entries `tcnn_<resnet>`: a timm ResNet built by timm, transformed, then loaded.

    timm.create_model('tcnn_resnetrs50', pretrained=True, pretrained_cfg_overlay=dict(file='rs50.pth'))
    timm.create_model('local-dir:exported_tcnn', pretrained=True)  # or 'hf-hub:user/repo'

`pretrained=True` reads the weights through timm's own loading code (the hub, a URL, a local
directory, or offline `pretrained_cfg_overlay=dict(file=PATH)`) and decides from their keys what
they are: a plain ResNet's (timm's, or a user's) are loaded into the CNN, which is then transformed;
a T-CNN's (a fine-tuned one, `save_for_hf` of this model) are loaded into the transformed model.
timm's adaptations apply either way (a classifier reset when `num_classes` differs from the
checkpoint's, the stem's `in_chans`). A pretrained tag selects the CNN's weights:
`tcnn_resnet50.a1_in1k`. The transform options (`stages`, `init`, `keep_stride`,
`locality_strength`, `gating`) are model kwargs, recorded in the model's reconstruction arguments
(what `save_for_hf` writes as `model_args`); every other kwarg goes to the CNN (`num_classes`,
`drop_path_rate`, ...). The model keeps the CNN's `pretrained_cfg` (mean, std, input size of the
weights it was loaded from).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from functools import partial
from typing import Any

import timm
import torch
from timm.models import (
    FeatureDictNet,
    FeatureGraphNet,
    FeatureHookNet,
    FeatureListNet,
    generate_default_cfgs,
    get_pretrained_cfg,
    load_pretrained,
    register_model,
)
from torch import nn

from convbias.timm_compat import FeatureGetterNet
from convbias.weights import check_keys

from .transform import resolve_stages, transform

TRANSFORM_KWARGS = [name for name in inspect.signature(transform).parameters if name != "cnn"]


def _cnn_names() -> list[str]:
    """timm's plain ResNets: resnet<depth>[letter] (ResNet-B/C/D/S/T) and resnetrs<depth>."""
    return [name for name in timm.list_models(module="resnet") if re.fullmatch(r"resnet(rs)?\d+[a-z]?", name)]


def _check_pretrained_file(overlay: dict | None) -> None:
    path = (overlay or {}).get("file")
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"pretrained file {path!r} does not exist")


# every feature_cls timm's builder accepts for its ResNets (the getter runs ResNet.forward_intermediates)
FEATURE_CLASSES = {
    "list": FeatureListNet,
    "dict": FeatureDictNet,
    "hook": FeatureHookNet,
    "fx": FeatureGraphNet,
    "getter": FeatureGetterNet,
}


def _feature_wrapper(model: nn.Module, out_indices, feature_cls, feature_kwargs: dict[str, Any]) -> nn.Module:
    """timm's features_only wrapper around the transformed model (its feature_info has the new reductions);
    `feature_cls` as timm's builder reads it: a name (any case; 'hook' in it selects the hook wrapper) or a class."""
    feature_cls = feature_cls or "list"
    if isinstance(feature_cls, str):
        name = "hook" if "hook" in feature_cls.lower() else feature_cls.lower()
        if name not in FEATURE_CLASSES:
            raise ValueError(f"feature_cls={feature_cls!r}: a T-CNN supports feature_cls in {sorted(FEATURE_CLASSES)}")
        feature_cls = FEATURE_CLASSES[name]
    features = feature_cls(model, out_indices=out_indices, **feature_kwargs)
    features.pretrained_cfg = features.default_cfg = {  # as timm's builder does (pretrained_cfg_for_features)
        k: v for k, v in model.pretrained_cfg.items() if k not in ("num_classes", "classifier", "global_pool")
    }
    return features


def _weights_source(cfg: dict[str, Any]) -> str:
    """How a message names the weights timm reads for `cfg`."""
    return str(cfg.get("file") or cfg.get("hf_hub_id") or cfg.get("url") or "the pretrained weights")


def _adapted_keys(cfg: dict[str, Any]) -> set[str]:
    """Keys timm's load_pretrained adapts after the filter: the classifier (reset for another class count)
    and the stem (other `in_chans`); they take no part in deciding what a checkpoint is."""
    names = []
    for field in ("classifier", "first_conv"):
        value = cfg.get(field) or ()
        names += [value] if isinstance(value, str) else list(value)
    return {f"{name}.{suffix}" for name in names for suffix in ("weight", "bias")}


def _kept(model: nn.Module, dropped: set[str]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k not in dropped}


def _to_tcnn_state_dict(
    state_dict: dict[str, torch.Tensor],
    model: nn.Module,
    *,
    cnn_name: str,
    cnn_kwargs: dict[str, Any],
    transform_kwargs: dict[str, Any],
    options: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """timm's `filter_fn`: the transformed model's state dict from a T-CNN checkpoint (as is) or from a
    plain ResNet checkpoint (loaded into a fresh CNN, transformed); ValueError naming both otherwise."""
    source = _weights_source(model.pretrained_cfg)
    adapted = _adapted_keys(model.pretrained_cfg)
    given = {k: v for k, v in state_dict.items() if k not in adapted}
    tcnn_keys = {k for k in model.state_dict() if k not in adapted}
    with torch.device("meta"):
        plain_meta = timm.create_model(cnn_name, **{k: v for k, v in cnn_kwargs.items() if k != "device"})
    plain_keys = {k for k in plain_meta.state_dict() if k not in adapted}
    described = ", ".join(f"{k}={v}" for k, v in options.items())
    if set(given) == tcnn_keys:
        check_keys(_kept(model, adapted), given, source, f"tcnn_{cnn_name}")
        return state_dict
    if set(given) == plain_keys:
        check_keys(_kept(plain_meta, adapted), given, source, cnn_name)
        cnn = timm.create_model(cnn_name, **cnn_kwargs)
        cnn.load_state_dict(given, strict=False)  # the adapted keys go back below, for timm to adapt
        converted = transform(cnn, **transform_kwargs).state_dict()
        converted.update({k: v for k, v in state_dict.items() if k in adapted})
        return converted
    closer_is_tcnn = len(set(given) & tcnn_keys) > len(set(given) & plain_keys)
    try:
        closer = model if closer_is_tcnn else plain_meta
        check_keys(closer.state_dict(), state_dict, source, f"tcnn_{cnn_name}" if closer_is_tcnn else cnn_name)
    except ValueError as mismatch:
        expected = (
            f"expected tcnn_{cnn_name} ({described}) or its CNN {cnn_name}"
            if closer_is_tcnn
            else f"the CNN {cnn_name} of tcnn_{cnn_name}, or tcnn_{cnn_name} with {described}"
        )
        raise ValueError(f"{mismatch} ({expected})") from None
    raise ValueError(f"{source} holds neither {cnn_name} nor tcnn_{cnn_name} ({described}) weights")


def _update_cfg(model: nn.Module) -> None:
    """The CNN's pretrained cfg with the pool size of the transformed model (a removed stride doubles it)."""
    cfg = dict(model.pretrained_cfg)
    reduction = model.feature_info[-1]["reduction"]
    cfg["pool_size"] = tuple(side // reduction for side in cfg["input_size"][1:])
    cfg["architecture"] = f"tcnn_{cfg.get('architecture', '')}"
    model.pretrained_cfg = model.default_cfg = cfg


def _transform_options(cnn: nn.Module, transform_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The transform's options in full (stages resolved to numbers): the model's reconstruction arguments,
    so a saved config rebuilds the same T-CNN even if a default changes."""
    options = {"stages": resolve_stages(cnn, transform_kwargs.get("stages"))}
    defaults = inspect.signature(transform).parameters
    for name in TRANSFORM_KWARGS:
        value = transform_kwargs.get(name, defaults[name].default)
        if name != "stages" and value is not None:
            options[name] = value
    return options


FEATURE_KWARGS = ("flatten_sequential", "output_fmt", "norm", "prune", "return_dict", "out_map")


def create_tcnn(cnn_name: str, pretrained: bool = False, **kwargs) -> nn.Module:
    """Build timm's `cnn_name`, transform it, load pretrained weights of the CNN or of the T-CNN if asked;
    with `features_only=True` the transformed model goes into timm's feature wrapper (not the CNN)."""
    transform_kwargs = {name: kwargs.pop(name) for name in TRANSFORM_KWARGS if name in kwargs}
    features_only = kwargs.pop("features_only", False)
    out_indices = kwargs.pop("out_indices", (0, 1, 2, 3, 4))
    feature_cls = kwargs.pop("feature_cls", None)
    feature_kwargs = {name: kwargs.pop(name) for name in FEATURE_KWARGS if name in kwargs}
    pretrained_cfg = kwargs.pop("pretrained_cfg", None)
    overlay = kwargs.pop("pretrained_cfg_overlay", None)
    cache_dir = kwargs.pop("cache_dir", None)
    kwargs.pop("pretrained_model_args", None)  # what a saved config recorded: already among kwargs
    if pretrained:
        _check_pretrained_file(overlay)
    cnn = timm.create_model(cnn_name, pretrained_cfg=pretrained_cfg, pretrained_cfg_overlay=overlay, **kwargs)
    options = _transform_options(cnn, transform_kwargs)
    cnn_args = dict(getattr(cnn, "_model_args", {}))
    model = transform(cnn, **transform_kwargs)
    model._model_args = {**cnn_args, **options}
    if pretrained:
        filter_fn = partial(
            _to_tcnn_state_dict,
            cnn_name=cnn_name,
            cnn_kwargs=kwargs,
            transform_kwargs=transform_kwargs,
            options=options,
        )
        load_pretrained(
            model,
            pretrained_cfg=model.pretrained_cfg,
            num_classes=model.num_classes,
            in_chans=kwargs.get("in_chans", 3),
            filter_fn=filter_fn,
            cache_dir=cache_dir,
        )
    _update_cfg(model)
    return _feature_wrapper(model, out_indices, feature_cls, feature_kwargs) if features_only else model


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
