"""ConViT's attention layers: gated positional self-attention over patch tokens, and plain MHSA.

The GPSA math (factored positional attention, the fused hot path, the explicit path, the gate) lives
in `convbias.gpsa`, shared with the Transformed CNN's layers; `GPSA` here supplies the ViT geometry (a
grid of patch tokens, queries = keys) and timm's parameter layout. Parameter names and shapes follow
`timm.models.convit` (qk, v, proj, pos_proj, gating_param), so state dicts load both ways.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_module
from torch import nn

from convbias.gpsa import (
    GatedFactors,
    GatedPositionalAttention,
    GridSize,
    PositionalBasis,
    PositionalFactors,
    compute_dtype,
    factors_from_basis,
    gate_factors,
    grid_positions,
    kernel_offsets,
    paper_kernel_offsets,
    positional_attention,
    positional_basis,
    relative_encodings,
)

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # a build without torch.distributed has no sharded parameters
    DTensor = None

CONV_INITS = ("paper", "integer")  # the kernels of `GPSA.local_init`


def _grid_encodings(grid_size: GridSize, device: torch.device) -> torch.Tensor:
    """Relative encodings (N, N, 3) among the tokens of a grid (queries = keys)."""
    pos = grid_positions(grid_size[0], grid_size[1], device=device)
    return relative_encodings(pos, pos)


@register_notrace_module  # FX: a leaf, as timm registers its own GPSA (custom autograd hot path inside)
class GPSA(GatedPositionalAttention):
    """Gated positional self-attention over a grid of patch tokens (no class token)."""

    # the eager forward's caches (dicts keyed by (grid, device)): TorchScript, which cannot type them once a
    # forward has filled them, skips them, as the scripted forward never reads them
    __jit_ignored_attributes__ = ["_rel_cache", "_basis_cache"]

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        locality_strength: float = 1.0,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide the width dim={dim}")
        self.num_heads = num_heads
        self.dim = dim
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.locality_strength = locality_strength

        self.qk = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.pos_proj = nn.Linear(3, num_heads)
        self.gating_param = nn.Parameter(torch.ones(num_heads))
        self._rel_cache: dict = {}
        self._basis_cache: dict = {}

    # -- geometry: queries and keys are the patch tokens ------------------------------------------
    def relative_encodings(self, grid_size: GridSize, device: torch.device) -> torch.Tensor:
        """(N, N, 3) encodings of the token grid, cached for the last grid (not under TorchScript,
        whose module attributes cannot be a dict keyed by tuples)."""
        if torch.jit.is_scripting():
            return _grid_encodings(grid_size, device)
        key = (tuple(grid_size), str(device))
        if key not in self._rel_cache:
            self._rel_cache = {key: _grid_encodings(grid_size, device)}  # keep one grid: sizes rarely alternate
        return self._rel_cache[key]

    def positional_attention(self, grid_size: GridSize) -> torch.Tensor:
        """(H, N, N) positional attention for a grid of this size (dense; the explicit path's)."""
        rel = self.relative_encodings(grid_size, self.pos_proj.weight.device)
        return positional_attention(rel, self.pos_proj.weight, self.pos_proj.bias)

    def positional_basis(self, grid_size: GridSize) -> PositionalBasis:
        """The factors' `PositionalBasis` for the token grid, cached for the last grid."""
        device = self.pos_proj.weight.device
        key = (tuple(grid_size), str(device))
        if key not in self._basis_cache:
            rows, cols = (torch.arange(n, dtype=torch.float32, device=device) for n in grid_size)
            self._basis_cache = {key: positional_basis(rows, cols, rows, cols)}
        return self._basis_cache[key]

    def positional_factors(self, grid_size: GridSize) -> PositionalFactors:
        """The same attention in factored form (the hot path's): rows (H, Hp, Hp), cols (H, Wp, Wp)."""
        return factors_from_basis(self.pos_proj.weight, self.pos_proj.bias, self.positional_basis(grid_size))

    def _qkv(self, x: torch.Tensor, weight: torch.Tensor | None = None):
        """Queries, keys and values from one GEMM: timm's separate `qk` and `v` weights, concatenated
        (`weight`: that concatenation when made beforehand for several layers, `shared_operands`)."""
        b, n, _c = x.shape
        if weight is None:
            weight = torch.cat([self.qk.weight, self.v.weight])
        bias = None if self.qk.bias is None else torch.cat([self.qk.bias, self.v.bias])
        return F.linear(x, weight, bias).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)

    def attention(self, x: torch.Tensor, grid_size: GridSize) -> torch.Tensor:
        """The explicit, normalized attention matrix A, shape (B, H, N, N) (before dropout)."""
        q, k, _ = self._qkv(x).unbind(0)
        return self.explicit_attention(q, k, self.positional_attention(grid_size))

    def forward(self, x: torch.Tensor, grid_size: GridSize, shared: LayerOperands | None = None) -> torch.Tensor:
        """shared: this layer's operands if computed with the other layers' (`shared_operands`)."""
        b, n, c = x.shape
        if shared is None:
            q, k, v = self._qkv(x).unbind(0)
            out = self.attend(q, k, v, grid_size, self.attn_drop.p)
        else:
            q, k, v = self._qkv(x, shared.qkv_weight).unbind(0)
            gated = GatedFactors(shared.weighted_rows, shared.cols_per_key_row, shared.content_weight)
            out = self.attend(q, k, v, grid_size, self.attn_drop.p, gated)
        x = out.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(x))

    @torch.no_grad()
    def local_init(self, locality_strength: float | None = None, offsets: str = "paper") -> None:
        """Convolutional initialization (Eq. 7.5): W_val = I, heads on a k x k kernel of offsets.

        offsets: "paper" (`paper_kernel_offsets`: the official code's and timm's, the same values as
        timm's `GPSA.local_init`: a head count that is not a square keeps its extra heads' random
        v_pos, scaled by alpha as theirs) or "integer" (`kernel_offsets`: one target pixel per head)."""
        if offsets not in CONV_INITS:
            raise ValueError(f"offsets={offsets!r} must be one of {CONV_INITS}")
        self.v.weight.copy_(torch.eye(self.dim))
        alpha = self.locality_strength if locality_strength is None else locality_strength
        if offsets == "integer":
            self.set_conv_init(kernel_offsets(self.num_heads), alpha)
            return
        centers = paper_kernel_offsets(self.num_heads)
        weight = self.pos_proj.weight
        weight[: len(centers)] = torch.cat([2 * centers, -torch.ones(len(centers), 1)], dim=1)
        weight.mul_(float(alpha))


def _sharded(parameter: torch.Tensor) -> bool:
    """Whether a parameter is a DTensor (FSDP2 gathers a block's parameters only for its own forward)."""
    return DTensor is not None and isinstance(parameter, DTensor)


class LayerOperands(NamedTuple):
    """What a GPSA layer's forward takes when computed with the other layers' (`shared_operands`): timm's
    `qk` and `v` weights concatenated (3 C, C), and the fields of the layer's `GatedFactors` (flat: TorchScript
    does not take a NamedTuple inside a NamedTuple here)."""

    qkv_weight: torch.Tensor
    weighted_rows: torch.Tensor
    cols_per_key_row: torch.Tensor
    content_weight: torch.Tensor


def shared_operands(layers: list[GPSA], grid_size: GridSize) -> list[LayerOperands] | None:
    """Every layer's `LayerOperands` in one pass: the positional attention does not depend on the input,
    so the layers' factors and gates are computed as one stacked tensor each, forward and backward, and
    their query/key/value weights concatenated in one copy, instead of layer by layer. None (each layer
    computes its own) unless every layer takes `GatedFactors` (`takes_gated_factors`) with the same head
    count and width, and none is sharded."""
    if not layers:
        return None
    first = layers[0]
    queries = grid_size[0] * grid_size[1]
    for layer in layers:
        if (layer.num_heads, layer.dim) != (first.num_heads, first.dim) or (layer.pos_proj.bias is None) != (
            first.pos_proj.bias is None
        ):
            return None
        if not layer.takes_gated_factors(queries, layer.head_dim, layer.attn_drop.p) or _sharded(layer.gating_param):
            return None
    weight = torch.stack([layer.pos_proj.weight for layer in layers])
    bias = None if first.pos_proj.bias is None else torch.stack([layer.pos_proj.bias for layer in layers])
    gate = torch.stack([layer.gating_param for layer in layers]).sigmoid()
    rows, cols, content_weight = gate_factors(factors_from_basis(weight, bias, first.positional_basis(grid_size)), gate)
    dtype = compute_dtype(first.v.weight)
    if rows.dtype != dtype:  # one cast for all layers (the content weight stays fp32: the gate's gradient)
        rows, cols = rows.to(dtype), cols.to(dtype)
    qkv_weights = torch.cat([w for layer in layers for w in (layer.qk.weight, layer.v.weight)])
    return [
        LayerOperands(*operands)
        for operands in zip(
            qkv_weights.view(len(layers), 3 * first.dim, first.dim).unbind(0),
            rows.unbind(0),
            cols.unbind(0),
            content_weight.unbind(0),
        )
    ]


class MHSA(nn.Module):
    """Multi-head self-attention through PyTorch's fused kernel; explicit maps for diagnostics."""

    def __init__(
        self, dim: int, num_heads: int = 8, qkv_bias: bool = False, attn_drop: float = 0.0, proj_drop: float = 0.0
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide the width dim={dim}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _qkv(self, x: torch.Tensor):
        b, n, _ = x.shape
        return self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)

    def attention(self, x: torch.Tensor, grid_size: GridSize | None = None) -> torch.Tensor:
        """The explicit attention matrix, shape (B, H, N, N) (before dropout)."""
        q, k, _ = self._qkv(x).unbind(0)
        return ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)

    def forward(
        self, x: torch.Tensor, grid_size: GridSize | None = None, shared: LayerOperands | None = None
    ) -> torch.Tensor:
        """grid_size, shared: unused, GPSA's arguments (one signature for both kinds of blocks)."""
        b, n, c = x.shape
        q, k, v = self._qkv(x).unbind(0)
        drop = self.attn_drop.p if self.training else 0.0
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=drop).transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(x))
