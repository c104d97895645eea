"""The GPSA layer's math, shared by ConViT layers and Transformed CNN layers.

For head h, a content attention C = softmax(Q K^T / sqrt(d)) and a positional attention
P_h = softmax_j(v_pos^h . r_ij) are mixed with weight s_h = sigmoid(lambda_h):

    A_h = (1 - s_h) C_h + s_h P_h,        out_h = normalize(A_h) V_h

Both softmaxes have rows summing to one, so `normalize` is the identity up to rounding, and

    out_h = (1 - s_h) SDPA(Q_h, K_h, V_h) + s_h (P_h @ V_h).

That identity is the hot path (`gated_attention`): the content term goes through PyTorch's fused
`scaled_dot_product_attention`. The positional term needs no (N, N) matrix at all: the encodings
r = (dx, dy, dx^2 + dy^2) add an x part and a y part, so exp(v_pos . r) is a product of a function of
dx and one of dy, and so is each row's normalizer (a sum over a rectangular grid). Hence, exactly,

    P_h = rows_h (x) cols_h      (Kronecker product; rows_h: (Hp, Hp), cols_h: (Wp, Wp) softmaxes)

computed once per forward, without a batch dimension (`PositionalFactors`; several layers' at once when
they share a geometry: `factors_from_basis` takes stacked weights, `GatedFactors` folds in the gate), and P_h @ V_h is two
small GEMMs along the grid's two axes with the batch folded into the columns: (Hp + Wp) / (Hp * Wp)
of the dense product's work, 1/7 at 14 x 14. No (B, H, N, N) tensor is created in the forward or the
backward, nor an (H, N, N) one. The hot path may instead apply the dense P (H, N, N) (input-independent
and small) in one GEMM per head with the batch folded into the columns (tensor-core shapes, 7x the
FLOPs), or run `convbias.gpsa.fused`'s Triton kernel, content and positional terms in one pass over
the keys (`positional_product`; "auto" picks per device type by `resolve_positional_product`; the same
function every way; the autograd Functions of the two unfused products are in `convbias.gpsa.positional_mix`).
(When each head's value is
wider than the query count, as in a Transformed CNN's late stages, forming the mixed attention once
stores less: `gated_attention` then does that instead.) The explicit path (`GatedPositionalAttention.explicit_attention`) materializes the
normalized A from the dense encodings r for attention maps, diagnostics and attention dropout, and is
the tests' reference for the hot path. It is also what a TorchScript-compiled model runs: TorchScript
has no custom autograd Function, and under `torch.jit.is_scripting()` `attend` takes the explicit path
(the same function, up to rounding), so eager mode and `torch.compile` keep the hot path.

`GatedPositionalAttention` is the base of both layer kinds (`convit.GPSA` on a ViT's tokens,
`transformed_cnn.GPSAConv2d` on a feature map): the gate with its test-time mask, the choice between the
two paths, the convolutional initialization of v_pos. Each subclass supplies its token geometry.
Importing this module registers no model.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import repeat
from torch import nn

from convbias.base.errors import ConfigError

from . import fused
from .positional_mix import DensePositionalMix, PositionalMix

GridSize = tuple[int, int]
# Cut-off of the positional attention's tiny weights: it is computed in float32. A default argument,
# not torch.finfo in the body, so that TorchScript (which has no torch.finfo) compiles it.
FP32_EPS = torch.finfo(torch.float32).eps


def grid_positions(height: int, width: int, stride: int = 1, device: torch.device | None = None) -> torch.Tensor:
    """(x, y) coordinates of the tokens of a height x width grid in row-major order, shape (N, 2).

    With `stride` s only every s-th row and column is kept (queries of a strided convolution)."""
    ys = torch.arange(0, height, stride, device=device, dtype=torch.float32)
    xs = torch.arange(0, width, stride, device=device, dtype=torch.float32)
    y, x = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([x.flatten(), y.flatten()], dim=-1)


def relative_encodings(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """Fixed relative encodings r_ij = (dx, dy, dx^2 + dy^2), delta = key_j - query_i; (Nq, Nk, 3)."""
    delta = key_positions[None, :, :] - query_positions[:, None, :]
    return torch.cat([delta, delta.pow(2).sum(-1, keepdim=True)], dim=-1)


def positional_attention(
    rel: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = FP32_EPS
) -> torch.Tensor:
    """P_h = softmax_j(v_pos^h . r_ij) for all heads at once: (Nq, Nk, 3) -> (H, Nq, Nk).

    weight, bias: those of pos_proj (v_pos), passed as tensors so that TorchScript compiles this.
    The dense form, straight from the encodings as the paper writes it: the explicit path's (attention
    maps, diagnostics, dropout, TorchScript) and the tests' reference for `positional_factors`. Weights
    below eps / Nk are set to 0 as in `axis_attention`."""
    nq, nk, _ = rel.shape
    logits = weight.float() @ rel.reshape(nq * nk, 3).t()
    if bias is not None:  # cancels in the softmax; kept for exact parity with timm
        logits = logits + bias.float()[:, None]
    attn = logits.view(-1, nq, nk).softmax(dim=-1)
    return attn.masked_fill(attn < eps / nk, 0.0)


class PositionalFactors(NamedTuple):
    """Positional attention of every head as the Kronecker product P_h = rows_h (x) cols_h.

    rows: (H, Qy, Ky) attention of query rows over key rows; cols: (H, Qx, Kx) the same for columns.
    Tokens are numbered row-major on both grids, so P_h[qy * Qx + qx, ky * Kx + kx] =
    rows_h[qy, ky] * cols_h[qx, kx]."""

    rows: torch.Tensor
    cols: torch.Tensor

    def dense(self) -> torch.Tensor:
        """The (H, Qy*Qx, Ky*Kx) matrix, for schedules and maps that need it whole."""
        heads, qy, ky = self.rows.shape
        _, qx, kx = self.cols.shape
        return (self.rows[:, :, None, :, None] * self.cols[:, None, :, None, :]).reshape(heads, qy * qx, ky * kx)


class PositionalBasis(NamedTuple):
    """What pos_proj's weights multiply in the factors' logits, for one query and key geometry.

    values: (3, Qy*Ky + Qx*Kx), one row per input of pos_proj (dx, dy, dx^2 + dy^2), one column per
    (query row, key row) pair of the rows factor, then per (query column, key column) pair of the columns
    factor: the rows factor takes the dy and squared terms, the columns factor the dx and squared terms.
    rows, cols: (Qy, Ky), (Qx, Kx)."""

    values: torch.Tensor
    rows: tuple[int, int]
    cols: tuple[int, int]


def positional_basis(
    query_rows: torch.Tensor, query_cols: torch.Tensor, key_rows: torch.Tensor, key_cols: torch.Tensor
) -> PositionalBasis:
    """The `PositionalBasis` of query and key grids given by their coordinates (float32)."""
    dy = (key_rows[None, :] - query_rows[:, None]).flatten()
    dx = (key_cols[None, :] - query_cols[:, None]).flatten()
    values = torch.stack(
        [
            torch.cat([torch.zeros_like(dy), dx]),
            torch.cat([dy, torch.zeros_like(dx)]),
            torch.cat([dy.square(), dx.square()]),
        ]
    )
    return PositionalBasis(values, (len(query_rows), len(key_rows)), (len(query_cols), len(key_cols)))


def _axis_softmax(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the keys (last dim), weights at or below eps / K set to 0 (together they change a row's
    output by less than float rounding): a local head makes many weights tiny or subnormal, and subnormal
    operands slow the CPU GEMMs several times over."""
    attn = logits.softmax(dim=-1)
    return F.threshold(attn, torch.finfo(attn.dtype).eps / logits.shape[-1], 0.0)


def factors_from_basis(weight: torch.Tensor, bias: torch.Tensor | None, basis: PositionalBasis) -> PositionalFactors:
    """P_h = softmax_k(v_pos^h . r_qk) in factored form for pos_proj weights (..., H, 3) and biases (..., H):
    any leading dimensions (several layers' at once), computed in float32 (elementwise, not a GEMM, whose
    TF32 or bf16 rounding the logits of a sharp head cannot take). The bias cancels in the softmaxes; it
    joins the logits anyway so that it stays in the graph (DDP expects every parameter to be used).
    Returns factors (..., H, Qy, Ky) and (..., H, Qx, Kx)."""
    logits = (weight.float()[..., None] * basis.values).sum(dim=-2)
    if bias is not None:  # constant along the keys: cancels in both softmaxes
        logits = logits + bias.float()[..., None]
    (qy, ky), (qx, kx) = basis.rows, basis.cols
    lead = logits.shape[:-1]
    if (qy, ky) == (qx, kx):  # both axes in one softmax
        rows, cols = _axis_softmax(logits.view(*lead, 2, qy, ky)).unbind(-3)
        return PositionalFactors(rows, cols)
    rows, cols = logits.split([qy * ky, qx * kx], dim=-1)
    return PositionalFactors(_axis_softmax(rows.view(*lead, qy, ky)), _axis_softmax(cols.view(*lead, qx, kx)))


def positional_factors(
    pos_proj: nn.Linear,
    query_rows: torch.Tensor,
    query_cols: torch.Tensor,
    key_rows: torch.Tensor,
    key_cols: torch.Tensor,
) -> PositionalFactors:
    """P_h = softmax_k(v_pos^h . r_qk) in factored form, for query and key grids given by coordinates."""
    return factors_from_basis(
        pos_proj.weight, pos_proj.bias, positional_basis(query_rows, query_cols, key_rows, key_cols)
    )


class GatedFactors(NamedTuple):
    """The Kronecker product's operands with the gate s_h folded in, for the hot path's
    `convbias.gpsa.positional_mix.PositionalMix`: weighted_rows = s_h rows_h (H, Qy, Ky); cols_per_key_row =
    cols_h repeated for every key row (H*Ky, Qx, Kx), to batch the columns' GEMMs over the key rows;
    content_weight = 1 - s_h (H,). Leading dimensions, if any, stack several layers'."""

    weighted_rows: torch.Tensor
    cols_per_key_row: torch.Tensor
    content_weight: torch.Tensor


def gate_factors(positional: PositionalFactors, gate: torch.Tensor) -> GatedFactors:
    """`GatedFactors` from the factors (..., H, Qy, Ky), (..., H, Qx, Kx) and the gate (..., H)."""
    rows, cols = positional
    return GatedFactors(
        weighted_rows=rows * gate[..., None, None],
        cols_per_key_row=repeat(cols, "... h q k -> ... (h r) q k", r=rows.shape[-1]),
        content_weight=1 - gate,
    )


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a Linear layer with this weight outputs here: autocast's when it is on, else the weight's (on a
    device type without autocast too, such as the meta device of a model built without memory)."""
    device_type = weight.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


# How the hot path applies P to V: "kronecker" (rows, then columns: Ky + Kx terms per output) or "dense"
# (the (H, Nq, Nk) matrix in one GEMM: Ky * Kx terms, tensor-core shapes); "auto" picks per device type.
POSITIONAL_PRODUCTS = ("auto", "kronecker", "dense", "fused")
# What "auto" runs per device type: the product measured faster there (docs/gpu.md, docs/benchmarks.md).
# On an H100 the factored product beat the dense one in ConViT-Ti's training step, eager and compiled:
# its 7x fewer FLOPs outweigh the short contractions. Unmeasured device types take the same.
AUTO_POSITIONAL_PRODUCT = {"cpu": "kronecker", "cuda": "kronecker"}


def resolve_positional_product(product: str, device: torch.device) -> str:
    """The product the hot path runs ("kronecker", "dense" or "fused") for a `POSITIONAL_PRODUCTS` choice on
    a device: "auto" takes the one measured faster on that device type (`AUTO_POSITIONAL_PRODUCT`)."""
    if product == "auto":
        return AUTO_POSITIONAL_PRODUCT.get(device.type, "kronecker")
    if product not in POSITIONAL_PRODUCTS:
        raise ConfigError(f"positional_product={product!r}: expected one of {', '.join(POSITIONAL_PRODUCTS)}")
    return product


def set_positional_product(model: nn.Module, product: str) -> int:
    """Set how every GPSA layer of `model` applies P to V (one of `POSITIONAL_PRODUCTS`); returns how many
    layers it set. The same function whichever is chosen: a speed choice, not a model change."""
    resolve_positional_product(product, torch.device("cpu"))  # validates before any layer changes
    layers = [m for m in model.modules() if isinstance(m, GatedPositionalAttention)]
    for layer in layers:
        layer.positional_product = product
    return len(layers)


def gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positional: PositionalFactors,
    gate: torch.Tensor,
    product: str = "kronecker",
) -> torch.Tensor:
    """(1 - gate_h) softmax(Q K^T / sqrt(d)) V + gate_h P_h V: the GPSA hot path.

    q: (B, H, Nq, d); k: (B, H, Nk, d); v: (B, H, Nk, dv), or (B, 1, Nk, dv) for a value shared by
    all heads; positional: P in factored form; gate: (H,) weights in [0, 1]; product: "kronecker",
    "dense" or "fused", how P is applied to V (see `resolve_positional_product`). Returns (B, H, Nq, dv).

    "fused" runs `convbias.gpsa.fused`'s kernel (content and positional terms in one pass over the
    keys, any query grid, strided ones included) when the head and value widths allow
    (`fused.supports`: up to 128); wider values fall back to the schedules below, with the
    Kronecker product.

    Two schedules give the same result; the one that stores less is picked from the shapes:
    - values narrower than the query count (dv < Nq: a ViT's patch tokens): content through the fused
      SDPA kernel plus P @ V with the batch folded into the columns, axis by axis (`product` "kronecker")
      or as the dense (H, Nq, Nk) P in one GEMM ("dense"). Its largest extra tensor is the folded V,
      (H, Nk, B*dv) (a value shared by the heads is expanded to that); no (B, H, Nq, Nk) tensor exists.
    - values at least as wide as the query count (dv >= Nq: a Transformed CNN's late stages, where
      each head's value is the full C_in): the mixed attention (B, H, Nq, Nk) is then no larger than
      that folded V, so it is formed once and applied in one GEMM."""
    heads = q.shape[1]
    if product == "fused" and fused.supports(q, v):
        return fused.fused_gated_attention(q, k, v, positional.rows, positional.cols, gate)
    if narrow_values(q, v):
        # the operands formed at the factors' precision at least (fp32 under bf16), rounded once
        wide = PositionalFactors(*(factor.to(torch.promote_types(factor.dtype, v.dtype)) for factor in positional))
        if product == "dense":
            v = v.expand(-1, heads, -1, -1)
            content = F.scaled_dot_product_attention(q, k, v)
            return DensePositionalMix.apply(content, wide.dense().to(v.dtype), v, gate)
        return kronecker_gated_attention(q, k, v, gate_factors(wide, gate))
    content = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(dim=-1)
    attn = torch.lerp(content, positional.dense().to(content.dtype), gate.to(content.dtype).view(1, heads, 1, 1))
    if v.shape[1] == 1:  # shared value: one GEMM per image over all heads' queries
        b, _, nq, nk = attn.shape
        return (attn.reshape(b, heads * nq, nk) @ v[:, 0]).view(b, heads, nq, -1)
    return attn @ v


def narrow_values(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether each head's value is narrower than the query count: the schedules that apply P to V with
    the batch folded into the columns (else the mixed attention is formed, see `gated_attention`)."""
    return v.shape[-1] < q.shape[-2]


def kronecker_gated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gated: GatedFactors) -> torch.Tensor:
    """`gated_attention`'s "kronecker" product for narrow values, from the operands with the gate folded
    in: content through SDPA, (1 - s) content + s P V in `PositionalMix`. (B, H, Nq, dv)."""
    v = v.expand(-1, q.shape[1], -1, -1)
    content = F.scaled_dot_product_attention(q, k, v)
    weighted_rows, cols_per_key_row, content_weight = gated
    weighted_rows, cols_per_key_row = weighted_rows.to(v.dtype), cols_per_key_row.to(v.dtype)
    return PositionalMix.apply(content, weighted_rows, cols_per_key_row, v, content_weight)


def kernel_offsets(num_heads: int) -> torch.Tensor:
    """Centers of attention Delta^h (dx, dy) of the convolutional initialization, shape (H, 2).

    Heads tile a k x k kernel, k = ceil(sqrt(H)), in row-major order (head = row * k + col, the
    order of a conv filter's taps). Offsets run over range(-(k // 2), k - k // 2): symmetric for odd
    k, one more on the negative side for even k (2x2 -> {-1, 0}), so each head has one integer
    target pixel. The taps of a Transformed CNN's 3x3 conv, and the ConViT's `conv_init="integer"`
    (the paper's ConViT: `paper_kernel_offsets`, half-integers for even k).
    When H is not a perfect square the H offsets closest to the center are kept, in row-major order."""
    k = math.ceil(math.sqrt(num_heads))
    steps = torch.arange(k, dtype=torch.float32) - k // 2
    dy, dx = torch.meshgrid(steps, steps, indexing="ij")
    offsets = torch.stack([dx.flatten(), dy.flatten()], dim=-1)
    if num_heads < k * k:
        nearest = torch.argsort(offsets.pow(2).sum(-1), stable=True)[:num_heads]
        offsets = offsets[nearest.sort().values]
    return offsets


def paper_kernel_offsets(num_heads: int) -> torch.Tensor:
    """Centers of attention of the official ConViT code (and timm's `GPSA.local_init`), shape (k*k, 2).

    k = floor(sqrt(H)); offsets are centered on (k - 1) / 2, so an even kernel sits on half-integers
    (2x2 -> {-0.5, 0.5}: each head spreads over four pixels). Head order is theirs: head = col * k + row
    (dy varies fastest). Only the first k*k heads get an offset; the others keep their random init."""
    k = math.isqrt(num_heads)
    steps = torch.arange(k, dtype=torch.float32) - (k - 1) / 2
    dx, dy = torch.meshgrid(steps, steps, indexing="ij")
    return torch.stack([dx.flatten(), dy.flatten()], dim=-1)


class GatedPositionalAttention(nn.Module):
    """What every GPSA layer shares: the gate with its test-time mask, the hot and explicit paths.

    Subclasses own the parameters `pos_proj` (Linear(3, heads): v_pos) and `gating_param` (lambda, one
    per head), created in their own order so that their state dicts and initializations stay as they were."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = True  # False forces the explicit path (for tests and diagnostics)
        self.positional_product = "auto"  # how the hot path applies P to V: one of POSITIONAL_PRODUCTS
        self.gate_override: float | None = None  # test-time mask: 0 = content only, 1 = position only

    def gate(self) -> torch.Tensor:
        """Weight on the positional attention per head, sigma(lambda_h) unless overridden."""
        if self.gate_override is not None:
            return torch.full_like(self.gating_param, float(self.gate_override))
        return torch.sigmoid(self.gating_param)

    @torch.no_grad()
    def set_conv_init(self, offsets: torch.Tensor, locality_strength: float) -> None:
        """v_pos^h = alpha (2 Dx, 2 Dy, -1) (Eq. 7.5): head h attends around offset Delta^h, since then
        v_pos^h . r = -alpha (|delta - Delta^h|^2 - |Delta^h|^2), more sharply as alpha grows."""
        alpha = float(locality_strength)
        heads = offsets.shape[0]
        self.pos_proj.weight.copy_(alpha * torch.cat([2 * offsets, -torch.ones(heads, 1)], dim=1))

    def explicit_attention(self, q: torch.Tensor, k: torch.Tensor, positional: torch.Tensor) -> torch.Tensor:
        """The normalized mixed attention A, (B, H, Nq, Nk), from the dense positional attention (H, Nq, Nk)."""
        content = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(dim=-1)
        gate = self.gate().view(1, -1, 1, 1).to(content.dtype)
        attn = (1.0 - gate) * content + gate * positional.to(content.dtype)
        return attn / attn.sum(dim=-1, keepdim=True)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        grid: GridSize,
        attn_drop: float = 0.0,
        gated: GatedFactors | None = None,
    ) -> torch.Tensor:
        """Attention output (B, H, Nq, dv) over a token grid: the hot path, or the explicit one when
        `fused` is off, attention dropout (probability `attn_drop`) is active (it needs the materialized
        matrix) or the model is TorchScript-compiled (the hot path's autograd Function does not script;
        `torch.jit.is_scripting()` is resolved at compile time, so the hot path is not even compiled).
        `gated`: this layer's `GatedFactors` when computed beforehand (with other layers'), used where
        `takes_gated_factors` says; otherwise the layer computes its own."""
        dropout = self.training and attn_drop > 0.0
        if torch.jit.is_scripting() or not self.fused or dropout:
            attn = self.explicit_attention(q, k, self.positional_attention(grid))
            if dropout:
                attn = F.dropout(attn, p=attn_drop)
            return attn @ v
        if gated is not None and self.takes_gated_factors(q.shape[-2], v.shape[-1], attn_drop):
            return kronecker_gated_attention(q, k, v, gated)
        product = resolve_positional_product(self.positional_product, q.device)
        return gated_attention(q, k, v, self.positional_factors(grid), self.gate(), product)

    def takes_gated_factors(self, queries: int, value_width: int, attn_drop: float = 0.0) -> bool:
        """Whether the hot path runs on `GatedFactors` (the "kronecker" product with narrow values and the
        learned gate), so that they can be computed beforehand for several layers at once."""
        return (
            self.fused
            and not (self.training and attn_drop > 0.0)
            and self.gate_override is None
            and value_width < queries
            and resolve_positional_product(self.positional_product, self.gating_param.device) == "kronecker"
        )

    def positional_factors(self, grid: GridSize) -> PositionalFactors:
        """Factored positional attention for an input grid (height, width); the subclass's geometry."""
        raise NotImplementedError

    def positional_attention(self, grid: GridSize) -> torch.Tensor:
        """Dense positional attention (H, Nq, Nk) for an input grid (height, width); the subclass's geometry."""
        raise NotImplementedError
