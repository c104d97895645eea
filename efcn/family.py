"""The eFCN family's record (`convbias.base.family.Family`): what the tools get from it through
`convbias.families`, the deviation logged during training, and the measurements and masks the eFCN protocol
calls."""

from types import SimpleNamespace

from convbias.base.family import Family

from . import diagnostics
from .diagnostics import deviation, weight_sharing_violation
from .embedding import masked

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
