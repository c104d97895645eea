"""Transformed CNNs: pretrained timm ResNets whose late 3x3 convolutions become GPSA layers (chapter 8).

Importing the package registers `tcnn_<resnet>` models (tcnn_resnet50, tcnn_resnet50d,
tcnn_resnetrs50, ...) in timm's registry.
"""

from . import models
from .diagnostics import query_attention_maps, query_maps
from .gpsa_conv import GPSAConv2d
from .transform import INITS, gpsa_layers, remove_stage_stride, transform

__all__ = [
    "INITS",
    "GPSAConv2d",
    "gpsa_layers",
    "models",
    "query_attention_maps",
    "query_maps",
    "remove_stage_stride",
    "transform",
]
