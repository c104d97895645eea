"""eFCN: a CNN embedded in its equivalent fully connected network (chapter 6).

`embed(cnn, input_shape)` builds the eFCN; `deviation(model)` measures how far it moved from the
CNN subspace; `masked(model, "local" | "off_local")` evaluates one block of its weights; importing
the package registers vanilla_cnn, alexnet_cifar and their efcn_* / fcn_* variants in timm.
"""

from . import diagnostics, models
from .diagnostics import deviation, weight_sharing_violation
from .embedding import EmbeddedFCN, LocalLinear, OnFeatureMap, embed, masked, standard_fcn
from .models import AlexNetCIFAR, VanillaCNN

__all__ = [
    "AlexNetCIFAR",
    "EmbeddedFCN",
    "LocalLinear",
    "OnFeatureMap",
    "VanillaCNN",
    "deviation",
    "diagnostics",
    "embed",
    "masked",
    "models",
    "standard_fcn",
    "weight_sharing_violation",
]
