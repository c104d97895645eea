"""Transformed CNNs: pretrained timm ResNets whose late 3x3 convolutions become GPSA layers (chapter 8).

Importing the package registers `tcnn_<resnet>` models (tcnn_resnet50, tcnn_resnet50d,
tcnn_resnetrs50, ...) in timm's registry. `FAMILY` (`family`) is what the tools get from it (through
`convbias.families`): `--reparametrize tcnn`, the `tcnn_<resnet>` name such a run is exported as, and the
query-pixel maps of one image.
"""

from . import models
from .diagnostics import query_attention_maps, query_maps
from .family import FAMILY, exported_as
from .gpsa_conv import GPSAConv2d
from .transform import INITS, gpsa_layers, remove_stage_stride, transform

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
