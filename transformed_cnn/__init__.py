"""Transformed CNNs: pretrained timm ResNets whose late 3x3 convolutions become GPSA layers (chapter 8).

Importing the package registers `tcnn_<resnet>` models (tcnn_resnet50, tcnn_resnet50d,
tcnn_resnetrs50, ...) in timm's registry. `FAMILY` is what the tools get from it (through
`convbias.families`): `--reparametrize tcnn`, the `tcnn_<resnet>` name such a run is exported as, and the
query-pixel maps of one image.
"""

from convbias.base.family import Family

from . import models
from .diagnostics import query_attention_maps, query_maps, query_maps_or_none
from .gpsa_conv import GPSAConv2d
from .transform import INITS, gpsa_layers, remove_stage_stride, transform


def exported_as(resnet: str) -> str:
    """The registered T-CNN whose weights a ResNet run reparametrized with `tcnn` holds; it takes the
    transform's options as keyword arguments."""
    return f"tcnn_{resnet}"


FAMILY = Family(
    hub_tag="transformed-cnn",
    reparametrizations={"tcnn": transform},
    export_names={"tcnn": exported_as},
    query_maps=query_maps_or_none,
)

__all__ = [
    "FAMILY",
    "INITS",
    "GPSAConv2d",
    "exported_as",
    "gpsa_layers",
    "models",
    "query_attention_maps",
    "query_maps",
    "remove_stage_stride",
    "transform",
]
