"""Gated positional self-attention (GPSA): the math shared by ConViT layers and Transformed CNN layers.

`layer` holds the attention's two paths, its positional attention in factored form and
`GatedPositionalAttention`, the base of `convit.GPSA` and `transformed_cnn.GPSAConv2d`; `positional_mix`
the autograd Functions of the two unfused positional products; `fused` the Triton kernel (its source in
`fused_kernels`). The layer's names are imported from here. Importing this package registers no model.
"""

from .layer import (
    AUTO_POSITIONAL_PRODUCT,
    FP32_EPS,
    POSITIONAL_PRODUCTS,
    GatedFactors,
    GatedPositionalAttention,
    GridSize,
    PositionalBasis,
    PositionalFactors,
    compute_dtype,
    factors_from_basis,
    gate_factors,
    gated_attention,
    grid_positions,
    kernel_offsets,
    kronecker_gated_attention,
    narrow_values,
    paper_kernel_offsets,
    positional_attention,
    positional_basis,
    positional_factors,
    relative_encodings,
    resolve_positional_product,
    set_positional_product,
)

__all__ = [
    "AUTO_POSITIONAL_PRODUCT",
    "FP32_EPS",
    "POSITIONAL_PRODUCTS",
    "GatedFactors",
    "GatedPositionalAttention",
    "GridSize",
    "PositionalBasis",
    "PositionalFactors",
    "compute_dtype",
    "factors_from_basis",
    "gate_factors",
    "gated_attention",
    "grid_positions",
    "kernel_offsets",
    "kronecker_gated_attention",
    "narrow_values",
    "paper_kernel_offsets",
    "positional_attention",
    "positional_basis",
    "positional_factors",
    "relative_encodings",
    "resolve_positional_product",
    "set_positional_product",
]
