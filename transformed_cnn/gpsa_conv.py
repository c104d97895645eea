"""A k x k convolution recast as gated positional self-attention with k^2 heads (Eq. 8.2).

Head h of the layer stands for tap h of the filter (row-major, the order of W[:, :, ky, kx]). In the
convolutional configuration its positional attention selects the pixel at the tap's offset, so

    sum_h A^h X W_val W_out^h  =  conv(X, W)   when W_val = I and W_out^h = W[:, :, ky, kx]^T.

Shapes (C_in -> C_out, N_q queries, N_k keys):

- values: W_val is one C_in x C_in matrix shared by all heads (they play symmetric roles at init and
  sharing keeps the parameter count of the paper); each head's value dimension is C_in.
- output: W_out maps the concatenated heads, 9 * C_in, to C_out; it holds exactly the filter.
- queries and keys: each head has its own query and key of dimension d = C_in // heads, one
  Linear(C_in, 2 * heads * d) like a ViT's (about 2 C_in^2 parameters, as the paper counts). A single
  C_in-dimensional query/key shared by all heads would give the same parameter count but forces every
  head that turns to content (sigma(lambda_h) -> 0) onto the same attention map; the paper's Fig. 8.5
  shows content heads attending differently, so heads get their own. C_in is rarely a multiple of 9,
  hence the floor. The counts then round to Table G.1's for all six ResNet-RS (36M -> 38M for
  ResNet50-RS: 35.69M -> 38.03M).
- tokens: the keys are the pixels of the zero-padded input map (padding tokens have zero query, key
  and value since no projection has a bias), the queries sit at the centers of the conv's windows on
  that padded grid, i.e. on the strided grid for a strided conv. Border queries thus see the same
  zeros as the convolution does; the output has exactly the conv's shape, no crop needed.

Hot path (`fused = True`): `convbias.gpsa.gated_attention`, the ConViT's, with the value shared by all
heads, (B, 1, N_k, C_in), and the positional attention P computed once per forward in factored
form (query rows x padded key rows, query columns x padded key columns). It picks its schedule from
the shapes: in late stages (C_in >= N_q) it mixes the two attentions first and applies them in one
GEMM; in early stages (C_in < N_q) the content term goes through SDPA and P @ V is applied axis by
axis with the batch folded into the columns, without a (B, heads, N_q, N_k) tensor. With
`positional_product = "fused"` a layer whose C_in is at most `convbias.gpsa.fused.FUSED_MAX_VALUE_WIDTH`
(128: a ResNet-50's first two stages) runs the fused Triton kernel instead, strided queries included
(the kernel takes any query grid over the padded key grid and the value shared by the heads); wider
layers (later stages) keep the schedules above. `fused = False` runs the explicit path: the normalized
attention of `attention()`, then one product with the value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers import register_notrace_module, to_2tuple, trunc_normal_
from torch import nn
from torch.utils.checkpoint import checkpoint

from convbias.gpsa import (
    GatedPositionalAttention,
    GridSize,
    PositionalFactors,
    grid_positions,
    kernel_offsets,
    positional_attention,
    positional_factors,
    relative_encodings,
)


class Geometry(NamedTuple):
    """Token layout of a GPSAConv2d for one input size (a NamedTuple: TorchScript compiles it)."""

    out_size: tuple[int, int]  # the conv's output (height, width)
    query_index: torch.Tensor  # the queries' indices among the padded grid's tokens, (N_q,)
    rel: torch.Tensor  # relative encodings (N_q, N_k, 3), for the dense positional attention
    axes: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # query rows, query cols, key rows, key cols


def _conv_output_length(size: int, kernel: int, padding: int, dilation: int, stride: int) -> int:
    """Output length of a convolution along one axis, the formula of `nn.Conv2d`."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


@register_notrace_module  # FX: a leaf, like timm's GPSA (its geometry branches on the input size)
class GPSAConv2d(GatedPositionalAttention):
    """Gated positional self-attention shaped like `nn.Conv2d`: NCHW in, NCHW out, same output size."""

    # the eager forward's cache (a dict keyed by input size and device): TorchScript, which cannot type it once a
    # forward has filled it, skips it, as the scripted forward never reads it
    __jit_ignored_attributes__ = ["_geometry_cache"]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 1,
        dilation: int | tuple[int, int] = 1,
        bias: bool = False,
        locality_strength: float = 1.0,
        gating: float = 1.0,
    ):
        super().__init__()
        kernel_size = to_2tuple(kernel_size)
        if kernel_size[0] != kernel_size[1]:
            raise ValueError(f"GPSAConv2d needs a square kernel (one head per tap), got kernel_size={kernel_size}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.stride = to_2tuple(stride)
        self.padding = to_2tuple(padding)
        self.dilation = to_2tuple(dilation)
        self.num_heads = kernel_size[0] ** 2
        self.qk_head_dim = max(1, in_channels // self.num_heads)

        self.qk = nn.Linear(in_channels, 2 * self.num_heads * self.qk_head_dim, bias=False)
        self.v = nn.Linear(in_channels, in_channels, bias=False)
        self.proj = nn.Linear(self.num_heads * in_channels, out_channels, bias=bias)
        self.pos_proj = nn.Linear(3, self.num_heads)
        self.gating_param = nn.Parameter(torch.empty(self.num_heads))
        self._geometry_cache: dict = {}
        # keep only the input for the backward and recompute the forward there (see `forward`)
        self.recompute = True
        self.reset_parameters(locality_strength, gating)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, locality_strength: float, gating: float) -> GPSAConv2d:
        """The GPSA layer computing `conv` in the convolutional configuration (Eq. 8.2)."""
        if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError(
                "GPSAConv2d converts convolutions with groups=1, zero padding and numeric padding; got "
                f"groups={conv.groups}, padding_mode={conv.padding_mode!r}, padding={conv.padding!r}"
            )
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.dilation,
            bias=conv.bias is not None,
            locality_strength=locality_strength,
            gating=gating,
        ).to(device=conv.weight.device, dtype=conv.weight.dtype)
        with torch.no_grad():
            # W_out^h = W[:, :, ky, kx] for head h = ky * k + kx: columns ordered (head, input channel)
            layer.proj.weight.copy_(rearrange(conv.weight, "o i ky kx -> o (ky kx i)"))
            if conv.bias is not None:
                layer.proj.bias.copy_(conv.bias)
        return layer

    @torch.no_grad()
    def reset_parameters(self, locality_strength: float, gating: float) -> None:
        """Convolutional initialization: W_val = I, head h attends around tap h with strength alpha
        (v_pos^h = alpha (2 Dx, 2 Dy, -1), Eq. 7.5), lambda_h = gating; queries/keys as in ConViT."""
        trunc_normal_(self.qk.weight, std=0.02)
        self.v.weight.copy_(torch.eye(self.in_channels))
        trunc_normal_(self.proj.weight, std=0.02)
        if self.proj.bias is not None:
            self.proj.bias.zero_()
        self.set_conv_init(self.tap_offsets(), locality_strength)
        self.pos_proj.bias.zero_()
        self.gating_param.fill_(float(gating))

    def tap_offsets(self) -> torch.Tensor:
        """(dx, dy) pixel offset of each head's tap, row-major like the filter, dilation included."""
        return kernel_offsets(self.num_heads) * torch.tensor([self.dilation[1], self.dilation[0]], dtype=torch.float32)

    # -- geometry -------------------------------------------------------------------------------
    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """Spatial output size, the same formula as `nn.Conv2d`."""
        k = self.kernel_size[0]
        return (
            _conv_output_length(height, k, self.padding[0], self.dilation[0], self.stride[0]),
            _conv_output_length(width, k, self.padding[1], self.dilation[1], self.stride[1]),
        )

    def _geometry(self, height: int, width: int, device: torch.device) -> Geometry:
        """The token layout for an input of this size, cached for the last size (not under TorchScript,
        whose module attributes cannot be a dict keyed by tuples)."""
        if torch.jit.is_scripting():
            return self._build_geometry(height, width, device)
        key = (height, width, str(device))
        if key not in self._geometry_cache:  # keep one size: resolutions rarely alternate
            self._geometry_cache = {key: self._build_geometry(height, width, device)}
        return self._geometry_cache[key]

    def _build_geometry(self, height: int, width: int, device: torch.device) -> Geometry:
        """Token layout for an input of this size: padded key grid, query indices, relative encodings,
        and the axes' coordinates (query rows, query columns, key rows, key columns) for the factors."""
        out_h, out_w = self.output_size(height, width)
        if out_h < 1 or out_w < 1:
            raise ValueError(
                f"input {height}x{width} is too small for kernel {self.kernel_size}, padding {self.padding}"
            )
        pad_h, pad_w = height + 2 * self.padding[0], width + 2 * self.padding[1]
        center = self.kernel_size[0] // 2
        # window centers on the padded grid: row s*i + d*(k//2), column s*j + d*(k//2)
        rows = torch.arange(out_h, device=device) * self.stride[0] + self.dilation[0] * center
        cols = torch.arange(out_w, device=device) * self.stride[1] + self.dilation[1] * center
        query_index = (rows[:, None] * pad_w + cols[None, :]).flatten()
        key_pos = grid_positions(pad_h, pad_w, device=device)
        return Geometry(
            out_size=(out_h, out_w),
            query_index=query_index,
            rel=relative_encodings(key_pos[query_index], key_pos),
            axes=(
                rows.float(),
                cols.float(),
                torch.arange(pad_h, device=device, dtype=torch.float32),
                torch.arange(pad_w, device=device, dtype=torch.float32),
            ),
        )

    # -- pieces ---------------------------------------------------------------------------------
    def positional_attention(self, grid: GridSize) -> torch.Tensor:
        """(heads, N_q, N_k) positional attention for an input map of size grid = (height, width)."""
        rel = self._geometry(grid[0], grid[1], self.pos_proj.weight.device).rel
        return positional_attention(rel, self.pos_proj.weight, self.pos_proj.bias)

    def positional_factors(self, grid: GridSize) -> PositionalFactors:
        """The same attention in factored form (the hot path's): query rows x padded key rows, likewise columns."""
        return positional_factors(self.pos_proj, *self._geometry(*grid, self.pos_proj.weight.device).axes)

    def _qkv(self, x: torch.Tensor):
        """Queries (B, heads, N_q, d), keys (B, heads, N_k, d), value shared by the heads (B, 1, N_k, C_in)."""
        b, _c, h, w = x.shape
        geometry = self._geometry(h, w, x.device)
        pad_h, pad_w = self.padding
        tokens = F.pad(x, (pad_w, pad_w, pad_h, pad_h)).flatten(2).transpose(1, 2)  # (B, N_k, C_in)
        n_k = tokens.shape[1]
        qk = self.qk(tokens).view(b, n_k, 2, self.num_heads, self.qk_head_dim).permute(2, 0, 3, 1, 4)
        q = qk[0].index_select(2, geometry.query_index)
        return q, qk[1], self.v(tokens).unsqueeze(1)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """The explicit, normalized attention A, shape (B, heads, N_q, N_k) over the padded key grid."""
        q, k, _ = self._qkv(x)
        return self.explicit_attention(q, k, self.positional_attention(tuple(x.shape[-2:])))

    # -- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """NCHW in, NCHW out. With `recompute` on (the default) and gradients wanted, only the input is kept
        for the backward (torch.utils.checkpoint), which recomputes the layer's forward first: what a
        convolution keeps, instead of the queries, keys, values, both attentions and the heads' outputs."""
        if self.recompute and torch.is_grad_enabled() and not torch.jit.is_scripting():
            return self._recomputed_forward(x)
        return self._forward(x)

    @torch.jit.unused  # a scripted model runs `_forward` (TorchScript has no checkpoint)
    def _recomputed_forward(self, x: torch.Tensor) -> torch.Tensor:
        # the geometry cached first, outside the checkpoint: the checkpointed forward then only reads the cache
        # (torch.compile refuses a side effect inside a checkpoint, a graph break; eager would replay it)
        self._geometry(x.shape[-2], x.shape[-1], x.device)
        return checkpoint(self._forward, x, use_reentrant=False)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        q, k, v = self._qkv(x)
        heads = self.attend(q, k, v, (h, w))
        out_h, out_w = self._geometry(h, w, x.device).out_size
        out = self.proj(heads.transpose(1, 2).reshape(b, out_h * out_w, -1))  # (B, N_q, heads * C_in)
        return out.transpose(1, 2).reshape(b, self.out_channels, out_h, out_w)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, heads={self.num_heads}, qk_head_dim={self.qk_head_dim}"
        )
