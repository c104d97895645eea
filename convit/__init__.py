"""ConViT: vision transformers whose gated positional self-attention starts as a convolution.

Importing the package registers convit_* and deit_*_plus in timm's registry. The GPSA math shared
with the Transformed CNNs is in `convbias.gpsa`. `FAMILY` (`family`) is what the tools get from it (through
`convbias.families`): the attention diagnostics logged during training and the attention maps of one image.
"""

from . import diagnostics
from .attention import GPSA, MHSA
from .family import FAMILY
from .models import ConViT, checkpoint_filter_fn

__all__ = ["FAMILY", "GPSA", "MHSA", "ConViT", "checkpoint_filter_fn", "diagnostics"]
