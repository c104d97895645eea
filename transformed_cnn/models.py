"""timm registry entries `tcnn_<resnet>`: timm's ResNet with its late 3x3 convolutions recast as GPSA layers.

    timm.create_model('tcnn_resnetrs50', pretrained=True, pretrained_cfg_overlay=dict(file='rs50.pth'))
    timm.create_model('tcnn_resnet50.a1_in1k', pretrained=True)  # resnet50.a1_in1k's weights, transformed
    timm.create_model('local-dir:exported_tcnn', pretrained=True)  # or 'hf-hub:user/repo'

The entries are built by timm's `build_model_with_cfg`, as timm's ResNets are: the model it instantiates is
timm's ResNet (built by timm) after `transform`, so `pretrained=True` (the hub, a URL, a local directory, or
offline `pretrained_cfg_overlay=dict(file=PATH)`), timm's adaptations (a classifier reset for another
`num_classes`, the stem's `in_chans`) and `features_only` (any `feature_cls` timm's ResNets accept) are timm's
own. Each entry's pretrained cfgs are its CNN's, tag for tag: the CNN's weights and preprocessing. The
pretrained filter decides from the keys what the weights are: a plain ResNet's (timm's, or a user's) are
loaded into the CNN, which is then transformed; a T-CNN's (a fine-tuned one, `save_for_hf` of this model)
pass as they are. The transform options (`stages`, `init`, `keep_stride`, `locality_strength`, `gating`) are
model kwargs, recorded in full in the model's reconstruction arguments (what `save_for_hf` writes as
`model_args`); every other kwarg goes to the CNN (`num_classes`, `drop_path_rate`, ...).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from functools import partial
from typing import Any

import timm
import torch
from timm.models import build_model_with_cfg, generate_default_cfgs, get_arch_pretrained_cfgs, register_model
from timm.models.resnet import ResNet
from torch import nn

from convbias.base.weights import WEIGHTS_LOGGER, check_keys

from .transform import resolve_stages, transform

TRANSFORM_KWARGS = [name for name in inspect.signature(transform).parameters if name != "cnn"]


def _cnn_names() -> list[str]:
    """timm's plain ResNets: resnet<depth>[letter] (ResNet-B/C/D/S/T) and resnetrs<depth>."""
    return [name for name in timm.list_models(module="resnet") if re.fullmatch(r"resnet(rs)?\d+[a-z]?", name)]


def _check_pretrained_file(overlay: dict | None) -> None:
    """One line naming a missing `file` (timm raises a bare FileNotFoundError)."""
    path = (overlay or {}).get("file")
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"pretrained file {path!r} does not exist")


def _transform_options(cnn: ResNet, transform_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The transform's options in full (stages resolved to numbers): the model's reconstruction arguments,
    so a saved config rebuilds the same T-CNN even if a default changes."""
    options = {"stages": resolve_stages(cnn, transform_kwargs.get("stages"))}
    defaults = inspect.signature(transform).parameters
    for name in TRANSFORM_KWARGS:
        value = transform_kwargs.get(name, defaults[name].default)
        if name != "stages" and value is not None:
            options[name] = value
    return options


def _transformed_resnet(cnn_name: str, **kwargs: Any) -> ResNet:
    """What build_model_with_cfg instantiates: timm's `cnn_name`, built by timm with the CNN's kwargs, then
    transformed with the transform options; its reconstruction arguments are the CNN's plus the options."""
    transform_kwargs = {name: kwargs.pop(name) for name in TRANSFORM_KWARGS if name in kwargs}
    cnn = timm.create_model(cnn_name, **kwargs)
    options = _transform_options(cnn, transform_kwargs)
    cnn_args = dict(cnn._model_args)
    model = transform(cnn, **options)
    model._model_args = {**cnn_args, **options}
    return model


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


def _to_tcnn_state_dict(state_dict: dict[str, torch.Tensor], model: ResNet, cnn_name: str) -> dict[str, torch.Tensor]:
    """timm's `pretrained_filter_fn`: the transformed model's state dict from a T-CNN checkpoint (as is) or
    from a plain ResNet checkpoint (loaded into the CNN the model was built from, transformed with the same
    options, both read from its reconstruction arguments); ValueError naming both otherwise."""
    cnn_args = {k: v for k, v in model._model_args.items() if k not in TRANSFORM_KWARGS}
    options = {k: v for k, v in model._model_args.items() if k in TRANSFORM_KWARGS}
    source = _weights_source(model.pretrained_cfg)
    adapted = _adapted_keys(model.pretrained_cfg)
    given = {k: v for k, v in state_dict.items() if k not in adapted}
    tcnn_keys = {k for k in model.state_dict() if k not in adapted}
    with torch.device("meta"):
        plain_meta = timm.create_model(cnn_name, **cnn_args)
    plain_keys = {k for k in plain_meta.state_dict() if k not in adapted}
    described = ", ".join(f"{k}={v}" for k, v in options.items())
    if set(given) == tcnn_keys:
        check_keys(_kept(model, adapted), given, source, f"tcnn_{cnn_name}")
        logging.getLogger(WEIGHTS_LOGGER).info(f"T-CNN weights of tcnn_{cnn_name} ({described}), loaded as they are")
        return state_dict
    if set(given) == plain_keys:
        check_keys(_kept(plain_meta, adapted), given, source, cnn_name)
        logging.getLogger(WEIGHTS_LOGGER).info(
            f"{cnn_name} weights, transformed: the 3x3 convolutions of stage(s) "
            f"{', '.join(map(str, options['stages']))} became GPSA layers ({described})"
        )
        cnn = timm.create_model(cnn_name, **cnn_args)
        cnn.load_state_dict(given, strict=False)  # the adapted keys go back below, for timm to adapt
        converted = transform(cnn, **options).state_dict()
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


def _set_pool_size(model: ResNet) -> None:
    """The pool size of the transform applied (the registered cfgs hold the default transform's)."""
    cfg = dict(model.pretrained_cfg)
    reduction = model.feature_info[-1]["reduction"]
    cfg["pool_size"] = tuple(side // reduction for side in cfg["input_size"][1:])
    model.pretrained_cfg = model.default_cfg = cfg


def _create_tcnn(cnn_name: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    if pretrained:
        _check_pretrained_file(kwargs.get("pretrained_cfg_overlay"))
    model = build_model_with_cfg(
        partial(_transformed_resnet, cnn_name),
        f"tcnn_{cnn_name}",
        pretrained,
        pretrained_filter_fn=partial(_to_tcnn_state_dict, cnn_name=cnn_name),
        **kwargs,
    )
    if not kwargs.get("features_only"):
        _set_pool_size(model)
    return model


def _tcnn_cfgs(cnn_name: str) -> dict[str, dict[str, Any]]:
    """`tcnn_<cnn>.<tag>` for every pretrained cfg of the CNN, the default first: the CNN's weights (which
    `pretrained=True` transforms) and preprocessing, with the pool size of the default transform (the last
    stage at stride 1: twice the CNN's)."""
    cfgs = {}
    for name, cfg in get_arch_pretrained_cfgs(cnn_name).items():
        cfg = cfg.to_dict()
        cfg.pop("architecture", None)
        cfg.pop("tag", None)
        cfg["pool_size"] = tuple(2 * side for side in cfg["pool_size"])
        cfgs[f"tcnn_{name}"] = cfg
    return cfgs


def _make_entrypoint(cnn_name: str):
    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        return _create_tcnn(cnn_name, pretrained=pretrained, **kwargs)

    entrypoint.__name__ = entrypoint.__qualname__ = f"tcnn_{cnn_name}"
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = f"Transformed {cnn_name}: timm's {cnn_name} with its last stage's 3x3 convs as GPSA layers."
    return entrypoint


default_cfgs = generate_default_cfgs({name: cfg for cnn in _cnn_names() for name, cfg in _tcnn_cfgs(cnn).items()})

for _cnn_name in _cnn_names():
    globals()[f"tcnn_{_cnn_name}"] = register_model(_make_entrypoint(_cnn_name))
