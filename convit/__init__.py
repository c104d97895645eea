"""ConViT: vision transformers whose gated positional self-attention starts as a convolution.

Importing the package registers convit_* and deit_*_plus in timm's registry. The GPSA math shared
with the Transformed CNNs is in `convbias.gpsa`. `FAMILY` is what the tools get from it (through
`convbias.families`): the attention diagnostics logged during training and the attention maps of one image.
"""

from convbias.base.family import Family

from . import diagnostics
from .attention import GPSA, MHSA
from .models import ConViT, checkpoint_filter_fn

FAMILY = Family(
    hub_tag="convit",
    diagnostics={"attention": diagnostics.summary},  # any attention layer: timm's DeiTs and T-CNN gates too
    query_maps=diagnostics.query_maps_or_none,
)

__all__ = ["FAMILY", "GPSA", "MHSA", "ConViT", "checkpoint_filter_fn", "diagnostics"]
