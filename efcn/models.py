"""The CNNs of chapter 6, their eFCNs and the standard FCN baselines, registered in timm.

- `vanilla_cnn`: the VanillaCNN of Sec. 6.2.2, three (3x3 conv, ReLU, 2x2 max-pool) stages of
  `channels` channels and one Linear. Its eFCN at 64 channels on 32x32 RGB has ~0.49 B weights.
- `alexnet_cifar`: the AlexNet-style CNN for CIFAR of App. E.2 (five convs, three max-pools, a
  three-layer classifier with dropout); its eFCN at 32x32 has ~0.13 B weights.
- `efcn_<cnn>`: the eFCN of that CNN. `pretrained=True` reads weights through timm's loading code (a file
  with `pretrained_cfg_overlay=dict(file=PATH)`, a local directory, the Hub): an eFCN's own load as they
  are, a CNN's are loaded into the CNN and lifted (the filter decides from their keys).
  `cnn_checkpoint=PATH` (a train.py checkpoint or any state-dict file of this model's CNN) is that
  loading with the CNN's file; without either, the eFCN of the CNN's random init.
- `fcn_<cnn>`: the same fully connected architecture with PyTorch's default Linear init.
"""

from __future__ import annotations

import inspect
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from timm.models import build_model_with_cfg, generate_default_cfgs, get_pretrained_cfg, register_model
from torch import nn

from convbias.base.weights import check_keys, check_weights_file, resolve_weights_path

from .embedding import EmbeddedFCN, embed, standard_fcn

__all__ = ["AlexNetCIFAR", "VanillaCNN"]


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else tuple(size)


def _feature(channels: int, img_side: int, side: int, module: str) -> dict:
    """timm feature_info entry of a pooled map; reduction: the nearest power of 2 of the size ratio."""
    return dict(num_chs=channels, reduction=2 ** round(math.log2(img_side / max(side, 1))), module=module)


class _ClassifierCNN(nn.Sequential):
    """A CNN written as a flat chain of named layers ending in `head` (embeddable as is)."""

    __jit_unused_properties__ = ["input_shape", "num_features", "head_hidden_size"]  # Python-side metadata

    def __init__(
        self,
        layers: OrderedDict[str, nn.Module],
        num_classes: int,
        in_chans: int,
        img_size: tuple[int, int],
        global_pool: str | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(layers)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.img_size = img_size
        if device is not None or dtype is not None:  # timm.create_model passes them (timm >= 1.0.20)
            self.to(device=device, dtype=dtype)
        if num_classes == 0 or global_pool is not None:  # timm's convention: 0 classes -> the pre-logits
            self.reset_classifier(num_classes, global_pool)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (self.in_chans, *self.img_size)

    @property
    def num_features(self) -> int:
        """Channels of the last feature map (the input of the flatten)."""
        return [m for name, m in self.named_children() if isinstance(m, nn.Conv2d)][-1].out_channels

    @property
    def head_hidden_size(self) -> int:
        """Width of the pre-logits (the classifier's input): the flattened map, or the MLP's last layer."""
        return self.head.in_features if isinstance(self.head, nn.Linear) else self.head_width

    def _split(self) -> int:
        return list(self._modules).index("flatten")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The convolutional part: the unflattened (B, C, H, W) map."""
        for module in list(self._modules.values())[: self._split()]:
            x = module(x)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Flatten (the paper's CNNs flatten; they do not pool), the MLP if any, then the classifier."""
        for name, module in list(self._modules.items())[self._split() :]:
            if pre_logits and name == "head":
                break
            x = module(x)
        return x

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new classifier (Identity for 0) in the model's mode. The paper's CNNs flatten their last map
        instead of pooling it: `global_pool` 'flatten' (or None: unchanged) keeps that, '' with no classifier
        removes it, so that the model returns its last map as timm's models do; an MLP that reads the
        flat vector (AlexNet's) cannot lose it."""
        if global_pool not in (None, "flatten", ""):
            raise ValueError(
                f"global_pool={global_pool!r}: {type(self).__name__} flattens its last map (the paper's "
                "architecture), the only pooling it has; use None, 'flatten' or '' (no classifier)"
            )
        if global_pool == "":
            after_flatten = list(self._modules)[self._split() + 1 :]
            if num_classes or after_flatten != ["head"]:
                raise ValueError(
                    f"global_pool='': {type(self).__name__} can return its unflattened last map only "
                    "without a classifier (num_classes=0) and when nothing else reads the flat vector; "
                    f"after its flatten come {', '.join(after_flatten)}"
                )
        width = self.head_hidden_size
        if global_pool is not None:
            self.flatten = nn.Flatten() if global_pool == "flatten" else nn.Identity()
        weight = next(self.parameters())
        head = (
            nn.Linear(width, num_classes, device=weight.device, dtype=weight.dtype)
            if num_classes > 0
            else nn.Identity()
        )
        self.head_width = width
        self.head = head.train(self.training)
        self.num_classes = num_classes


class VanillaCNN(_ClassifierCNN):
    """Sec. 6.2.2: 3 x (Conv 3x3 padding 1, ReLU, MaxPool 2x2), Flatten, Linear."""

    def __init__(
        self,
        channels: int = 64,
        num_classes: int = 10,
        in_chans: int = 3,
        img_size: int | Sequence[int] = 32,
        depth: int = 3,
        global_pool: str | None = None,
        device=None,
        dtype=None,
    ):
        img_size = _pair(img_size)
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        height, width, chans = *img_size, in_chans
        feature_info = []
        for i in range(1, depth + 1):
            layers[f"conv{i}"] = nn.Conv2d(chans, channels, kernel_size=3, padding=1)
            layers[f"act{i}"] = nn.ReLU()
            layers[f"pool{i}"] = nn.MaxPool2d(2)
            height, width, chans = height // 2, width // 2, channels
            feature_info.append(_feature(chans, img_size[0], height, f"pool{i}"))
        if min(height, width) < 1:
            raise ValueError(f"VanillaCNN with depth {depth} needs img_size >= {2**depth}, got {img_size}")
        layers["flatten"] = nn.Flatten()
        layers["head"] = nn.Linear(channels * height * width, num_classes)
        super().__init__(layers, num_classes, in_chans, img_size, global_pool, device, dtype)
        self.feature_info = feature_info


class AlexNetCIFAR(_ClassifierCNN):
    """App. E.2: AlexNet for 32x32 images (5 convs, 3 max-pools 3x3/2, MLP head with dropout)."""

    def __init__(
        self,
        num_classes: int = 100,
        in_chans: int = 3,
        img_size: int | Sequence[int] = 32,
        drop_rate: float = 0.5,
        global_pool: str | None = None,
        device=None,
        dtype=None,
    ):
        img_size = _pair(img_size)
        stages = [  # (out channels, kernel, stride, padding, max-pool after)
            (64, 4, 2, 2, True),
            (192, 5, 1, 2, True),
            (384, 3, 1, 1, False),
            (256, 3, 1, 1, False),
            (256, 3, 1, 1, True),
        ]
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        (height, width), chans = img_size, in_chans
        feature_info = []
        for i, (out, kernel, stride, padding, pool) in enumerate(stages, start=1):
            layers[f"conv{i}"] = nn.Conv2d(chans, out, kernel, stride=stride, padding=padding)
            layers[f"act{i}"] = nn.ReLU()
            height, width = ((s + 2 * padding - kernel) // stride + 1 for s in (height, width))
            if pool:
                layers[f"pool{i}"] = nn.MaxPool2d(kernel_size=3, stride=2)
                height, width = ((s - 3) // 2 + 1 for s in (height, width))
                feature_info.append(_feature(out, img_size[0], height, f"pool{i}"))
            chans = out
        if min(height, width) < 1:
            raise ValueError(f"AlexNetCIFAR needs img_size >= 32, got {img_size}")
        layers["flatten"] = nn.Flatten()
        layers["drop1"] = nn.Dropout(drop_rate)
        layers["fc1"] = nn.Linear(chans * height * width, 512)
        layers["act6"] = nn.ReLU()
        layers["drop2"] = nn.Dropout(drop_rate)
        layers["fc2"] = nn.Linear(512, 512)
        layers["act7"] = nn.ReLU()
        layers["head"] = nn.Linear(512, num_classes)
        super().__init__(layers, num_classes, in_chans, img_size, global_pool, device, dtype)
        self.feature_info = feature_info


def _efcn_builder(cnn_cls: type[_ClassifierCNN], lift: Callable[..., EmbeddedFCN]) -> Callable[..., EmbeddedFCN]:
    """A model constructor: build the CNN (random init), lift it with `lift`."""

    def build(max_params: int | None = None, global_pool: str | None = None, **cnn_kwargs) -> EmbeddedFCN:
        # the CNN keeps its classifier (the eFCN's head is found as its last Linear); removed after the lift
        remove_head = cnn_kwargs.get("num_classes") == 0
        cnn = cnn_cls(**{k: v for k, v in cnn_kwargs.items() if not (k == "num_classes" and remove_head)})
        model = lift(cnn.eval(), cnn.input_shape, max_params=max_params)
        model.source_cnn = cnn_cls.__name__
        if remove_head or global_pool == "":
            model.reset_classifier(0 if remove_head else model.num_classes, global_pool)
        return model

    return build


# CNN arguments the filter does not take from the model's kwargs: the checkpoint's classes, the model's input; the
# CNN it lifts is built on the CPU in float32 (timm copies the result into the model's device and dtype)
FROM_CHECKPOINT_OR_MODEL = {"num_classes", "in_chans", "img_size", "global_pool", "device", "dtype"}


def _lift_cnn_weights(
    state_dict: dict[str, torch.Tensor], model: EmbeddedFCN, cnn_cls: type[_ClassifierCNN], cnn_kwargs: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """timm's `pretrained_filter_fn` of an eFCN: a CNN's weights (the keys of `cnn_cls`) are loaded into the CNN
    and lifted, so pretrained weights may be the CNN's; an eFCN's own pass as they are. The CNN has the
    checkpoint's classes (the pretrained cfg's): timm then resets the head of a model with other classes."""
    cfg = model.pretrained_cfg
    cnn = cnn_cls(**cnn_kwargs, num_classes=cfg["num_classes"], in_chans=model.in_chans, img_size=model.input_shape[1:])
    if set(state_dict) != set(cnn.state_dict()):
        return state_dict
    source = str(cfg.get("file") or cfg.get("hf_hub_id") or cfg.get("url") or "the pretrained weights")
    check_keys(cnn.state_dict(), state_dict, source, cnn_cls.__name__)
    cnn.load_state_dict(state_dict)
    return embed(cnn.eval(), cnn.input_shape).state_dict()


def _cnn_checkpoint_overlay(variant: str, cnn_checkpoint: str | Path, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The pretrained cfg of a file holding this model's CNN: its classes (unless the model has none) and
    input, so that timm loads the whole CNN, head included, and adapts nothing."""
    default = get_pretrained_cfg(variant)
    img_size = _pair(kwargs.get("img_size", default.input_size[1:]))
    check_weights_file(cnn_checkpoint)  # read safely first: timm's own error would advise unpickling it
    overlay = dict(file=str(resolve_weights_path(cnn_checkpoint)))
    overlay["input_size"] = (kwargs.get("in_chans", default.input_size[0]), *img_size)
    if kwargs.get("num_classes"):
        overlay["num_classes"] = kwargs["num_classes"]
    return overlay


def _cfg(num_classes: int, input_size: tuple[int, int, int], classifier: str, first_conv: str, pool_size=None) -> dict:
    return dict(
        num_classes=num_classes,
        input_size=input_size,
        fixed_input_size=True,
        classifier=classifier,
        first_conv=first_conv,
        pool_size=pool_size,
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        crop_pct=1.0,
        interpolation="bilinear",
        license="apache-2.0",
    )


default_cfgs = generate_default_cfgs(
    {
        "vanilla_cnn.untrained": _cfg(
            10, (3, 32, 32), "head", "conv1", pool_size=(4, 4)
        ),  # the last map (flattened, not pooled)
        "alexnet_cifar.untrained": _cfg(100, (3, 32, 32), "head", "conv1", pool_size=(1, 1)),
        "efcn_vanilla_cnn.untrained": _cfg(10, (3, 32, 32), "layers.head", "layers.conv1", pool_size=(4, 4)),
        "efcn_alexnet_cifar.untrained": _cfg(100, (3, 32, 32), "layers.head", "layers.conv1", pool_size=(1, 1)),
        "fcn_vanilla_cnn.untrained": _cfg(10, (3, 32, 32), "layers.head", "layers.conv1", pool_size=(4, 4)),
        "fcn_alexnet_cifar.untrained": _cfg(100, (3, 32, 32), "layers.head", "layers.conv1", pool_size=(1, 1)),
    }
)


def _create(variant: str, model_cls: Callable[..., nn.Module], pretrained: bool, **kwargs) -> nn.Module:
    if kwargs.pop("drop_path_rate", None):
        raise ValueError(f"{variant} has no residual branches to drop: drop_path_rate must be 0 (--drop-path 0)")
    if "cnn_checkpoint" in kwargs:  # the efcn_ entries have taken theirs
        raise ValueError(
            f"{variant}: cnn_checkpoint only applies to efcn_* models (fcn_* models use the default init; a CNN "
            "loads its own weights with pretrained=True, pretrained_cfg_overlay=dict(file=PATH))"
        )
    if kwargs.get("features_only") and variant.startswith(("efcn_", "fcn_")):
        raise ValueError(
            f"{variant}: features_only is not supported: an eFCN is fully connected, it has no feature maps "
            f"(use the CNN {variant.split('_', 1)[1]} for features)"
        )
    feature_cfg = dict(out_indices=(0, 1, 2))  # the pooled maps (VanillaCNN's default depth, AlexNet's three pools)
    return build_model_with_cfg(model_cls, variant, pretrained, feature_cfg=feature_cfg, **kwargs)


def _create_efcn(
    variant: str, cnn_cls: type[_ClassifierCNN], pretrained: bool, cnn_checkpoint: str | Path | None = None, **kwargs
) -> EmbeddedFCN:
    """`cnn_checkpoint=PATH` is timm's pretrained loading of that file (its weights replace every initial
    value, so with `pretrained=True` the pretrained weights are loaded instead and the file is not read)."""
    if cnn_checkpoint and not pretrained:
        pretrained = True
        overlay = _cnn_checkpoint_overlay(variant, cnn_checkpoint, kwargs)
        kwargs["pretrained_cfg_overlay"] = {**(kwargs.get("pretrained_cfg_overlay") or {}), **overlay}
    structure = set(inspect.signature(cnn_cls).parameters) - FROM_CHECKPOINT_OR_MODEL
    filter_fn = partial(_lift_cnn_weights, cnn_cls=cnn_cls, cnn_kwargs={k: kwargs[k] for k in structure & set(kwargs)})
    return _create(variant, _efcn_builder(cnn_cls, embed), pretrained, pretrained_filter_fn=filter_fn, **kwargs)


@register_model
def vanilla_cnn(pretrained: bool = False, **kwargs) -> VanillaCNN:
    """VanillaCNN (Sec. 6.2.2); kwargs: channels=64, depth=3, in_chans, img_size, num_classes."""
    return _create("vanilla_cnn", VanillaCNN, pretrained, **kwargs)


@register_model
def alexnet_cifar(pretrained: bool = False, **kwargs) -> AlexNetCIFAR:
    """AlexNet-style CNN for CIFAR-100 (App. E.2); kwargs: drop_rate=0.5, in_chans, img_size, num_classes."""
    return _create("alexnet_cifar", AlexNetCIFAR, pretrained, **kwargs)


@register_model
def efcn_vanilla_cnn(pretrained: bool = False, **kwargs) -> EmbeddedFCN:
    """eFCN of vanilla_cnn; kwargs of vanilla_cnn plus cnn_checkpoint=PATH, max_params."""
    return _create_efcn("efcn_vanilla_cnn", VanillaCNN, pretrained, **kwargs)


@register_model
def efcn_alexnet_cifar(pretrained: bool = False, **kwargs) -> EmbeddedFCN:
    """eFCN of alexnet_cifar; kwargs of alexnet_cifar plus cnn_checkpoint=PATH, max_params."""
    return _create_efcn("efcn_alexnet_cifar", AlexNetCIFAR, pretrained, **kwargs)


@register_model
def fcn_vanilla_cnn(pretrained: bool = False, **kwargs) -> EmbeddedFCN:
    """Standard FCN with the eFCN architecture of vanilla_cnn, PyTorch default init (baseline)."""
    return _create("fcn_vanilla_cnn", _efcn_builder(VanillaCNN, standard_fcn), pretrained, **kwargs)


@register_model
def fcn_alexnet_cifar(pretrained: bool = False, **kwargs) -> EmbeddedFCN:
    """Standard FCN with the eFCN architecture of alexnet_cifar, PyTorch default init (baseline)."""
    return _create("fcn_alexnet_cifar", _efcn_builder(AlexNetCIFAR, standard_fcn), pretrained, **kwargs)
