"""ConViT: vision transformers whose gated positional self-attention starts as a convolution."""
from .attention import GPSA, MHSA, gated_attention, positional_attention, relative_encodings, grid_positions, kernel_offsets
from .models import ConViT, checkpoint_filter_fn  # registers convit_* and deit_*_plus in timm's registry
