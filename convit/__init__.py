"""ConViT: vision transformers whose gated positional self-attention starts as a convolution."""
from .attention import GPSA, MHSA, gated_attention, positional_attention, relative_encodings, grid_positions, kernel_offsets
