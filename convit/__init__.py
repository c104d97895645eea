"""ConViT: vision transformers whose gated positional self-attention starts as a convolution."""
from .attention import (
    GPSA, MHSA, PositionalFactors, gated_attention, grid_positions, kernel_offsets, positional_attention,
    positional_factors, relative_encodings,
)
from .models import ConViT, checkpoint_filter_fn  # registers convit_* and deit_*_plus in timm's registry
