"""eFCN: a CNN embedded in its equivalent fully connected network (chapter 6).

`embed(cnn, input_shape)` builds the eFCN; `deviation(model)` measures how far it moved from the
CNN subspace; `masked(model, "local" | "off_local")` evaluates one block of its weights; importing
the package registers vanilla_cnn, alexnet_cifar and their efcn_* / fcn_* variants in timm. `FAMILY` (`family`) is
what the tools get from it (through `convbias.families`): the deviation logged during training, and the
measurements and masks the eFCN protocol calls.
"""

from . import diagnostics, models
from .diagnostics import deviation, weight_sharing_violation
from .embedding import EmbeddedFCN, LocalLinear, OnFeatureMap, embed, masked, standard_fcn
from .family import FAMILY
from .models import AlexNetCIFAR, VanillaCNN

__all__ = [
    "FAMILY",
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
