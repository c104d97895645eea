"""eFCN: a CNN embedded in its equivalent fully connected network (chapter 6).

`embed(cnn, input_shape)` builds the eFCN; `deviation(model)` measures how far it moved from the
CNN subspace; `masked(model, "local" | "off_local")` evaluates one block of its weights; importing
the package registers vanilla_cnn, alexnet_cifar and their efcn_* / fcn_* variants in timm. `FAMILY` is
what the tools get from it (through `convbias.families`): the deviation logged during training, and the
measurements and masks the eFCN protocol calls.
"""

from types import SimpleNamespace

from convbias.base.family import Family

from . import diagnostics, models
from .diagnostics import deviation, weight_sharing_violation
from .embedding import EmbeddedFCN, LocalLinear, OnFeatureMap, embed, masked, standard_fcn
from .models import AlexNetCIFAR, VanillaCNN

FAMILY = Family(
    hub_tag="efcn",
    diagnostics={"efcn": diagnostics.summary},
    initialization_kwargs=("cnn_checkpoint",),  # the trained CNN an eFCN starts from, read when it is built
    tools=SimpleNamespace(
        local_layers=diagnostics.local_layers,
        deviation=deviation,
        weight_sharing_violation=weight_sharing_violation,
        masked=masked,
    ),
)

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
