"""The Transformed CNN family's record (`convbias.base.family.Family`): what the tools get from it through
`convbias.families`, `--reparametrize tcnn`, the `tcnn_<resnet>` name such a run is exported as, and the
query-pixel maps of one image."""

from convbias.base.family import Family

from .diagnostics import query_maps_or_none
from .transform import transform


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
