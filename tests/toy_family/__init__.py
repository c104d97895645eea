"""A toy model family (tests/families/test_family_plugins.py): a whole family in one small package, plugged in as
a real one is, by its name alone: `convbias.families.load_families((*FAMILIES, "toy_family"))`.

Importing it registers `toy_net` (logits = a Linear of the flattened image) and `toy_scaled_toy_net` (the same,
times a learned scale) in timm's registry. Its `FAMILY` record gives the tools everything else: a diagnostic,
the `toy_scale` reparametrization (toy_net -> toy_scaled_toy_net) and the name such a run is exported as, the
maps `convbias-diagnostics --image` draws (each class's weight template), and its Hub tag.
"""

from __future__ import annotations

import torch
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from convbias.base.family import Family


class ToyNet(nn.Module):
    def __init__(self, num_classes: int = 10, in_chans: int = 3, img_size=8, scale: float | None = None):
        super().__init__()
        self.num_classes, self.in_chans = num_classes, in_chans
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)  # timm gives a pair
        self.num_features = in_chans * self.img_size[0] * self.img_size[1]  # the head's input, as timm's models say
        self.flatten = nn.Flatten()
        self.head = nn.Linear(self.num_features, num_classes)
        self.scale = None if scale is None else nn.Parameter(torch.tensor(float(scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.flatten(x))
        return logits if self.scale is None else self.scale * logits

    def get_classifier(self) -> nn.Module:
        return self.head


def _cfg() -> dict:
    return dict(num_classes=10, input_size=(3, 8, 8), fixed_input_size=True, mean=(0.5,) * 3, std=(0.5,) * 3,
                crop_pct=1.0, interpolation="bilinear", classifier="head", first_conv="head")  # fmt: skip


default_cfgs = generate_default_cfgs({"toy_net.untrained": _cfg(), "toy_scaled_toy_net.untrained": _cfg()})


@register_model
def toy_net(pretrained: bool = False, **kwargs) -> ToyNet:
    return build_model_with_cfg(ToyNet, "toy_net", pretrained, **kwargs)


@register_model
def toy_scaled_toy_net(pretrained: bool = False, scale: float = 1.0, **kwargs) -> ToyNet:
    return build_model_with_cfg(ToyNet, "toy_scaled_toy_net", pretrained, scale=scale, **kwargs)


def head_norm(model: nn.Module, images: torch.Tensor) -> dict[str, float]:
    """The diagnostic: the head's weight norm (and the scale, once there is one); {} for another family's model."""
    if not isinstance(model, ToyNet):
        return {}
    values = {"toy/head_norm": float(model.head.weight.norm())}
    return values if model.scale is None else {**values, "toy/scale": float(model.scale)}


def add_scale(model: ToyNet, scale: float = 1.0) -> ToyNet:
    """The reparametrization: the same logits times a learned scale, which starts at `scale`."""
    model.scale = nn.Parameter(torch.tensor(float(scale), device=model.head.weight.device))
    return model


def class_templates(model: nn.Module, image: torch.Tensor, query=None, layers=None):
    """Each class's weights over the image, drawn as one map per class (`convbias-diagnostics --image`)."""
    if not isinstance(model, ToyNet):
        return None
    maps = {"head": model.head.weight.detach().view(model.num_classes, model.in_chans, *model.img_size).mean(1)}
    return maps, {"head": (model.img_size[0] // 2, model.img_size[1] // 2)}, {}


FAMILY = Family(
    hub_tag="toy-family",
    diagnostics={"toy": head_norm},
    reparametrizations={"toy_scale": add_scale},
    export_names={"toy_scale": lambda name: f"toy_scaled_{name}"},
    query_maps=class_templates,
)
