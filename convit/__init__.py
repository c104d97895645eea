"""ConViT: vision transformers whose gated positional self-attention starts as a convolution.

Importing the package registers convit_* and deit_*_plus in timm's registry. The GPSA math shared
with the Transformed CNNs is in `convbias.gpsa`.
"""

from .attention import GPSA, MHSA
from .models import ConViT, checkpoint_filter_fn

__all__ = ["GPSA", "MHSA", "ConViT", "checkpoint_filter_fn"]
