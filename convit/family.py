"""The ConViT family's record (`convbias.base.family.Family`): what the tools get from it through
`convbias.families`, the attention diagnostics logged during training and the attention maps of one image."""

from convbias.base.family import Family

from . import diagnostics

FAMILY = Family(
    hub_tag="convit",
    diagnostics={"attention": diagnostics.summary},  # any attention layer: timm's DeiTs and T-CNN gates too
    query_maps=diagnostics.query_maps_or_none,
)
