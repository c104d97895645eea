"""Gated positional self-attention (GPSA) and plain multi-head self-attention.

GPSA mixes, per head h, a content attention C = softmax(Q K^T / sqrt(d)) and a positional attention
P_h = softmax_j(v_pos^h . r_ij) with weight s_h = sigmoid(lambda_h):

    A_h = (1 - s_h) C_h + s_h P_h,        out_h = normalize(A_h) V_h

Both softmaxes have rows summing to one, so `normalize` is the identity up to rounding, and

    out_h = (1 - s_h) SDPA(Q_h, K_h, V_h) + s_h (P_h @ V_h).

That identity is the hot path (`gated_attention`): the content term goes through PyTorch's fused
`scaled_dot_product_attention`; P depends only on token positions, so it is built once per forward
with shape (H, Nq, Nk) and applied as one GEMM with the batch folded into the columns. No
(B, H, N, N) tensor is created in the forward or the backward. (When each head's value is wider than
the key count, as in a Transformed CNN's late stages, forming the mixed attention once is cheaper:
`gated_attention` then does that instead.) The explicit path
(`GPSA.attention`) materializes A for attention maps, diagnostics and attention dropout.

Parameter names and shapes follow `timm.models.convit` (qk, v, proj, pos_proj, gating_param), so
state dicts load both ways.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

GridSize = Tuple[int, int]


def grid_positions(height: int, width: int, stride: int = 1, device=None) -> torch.Tensor:
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


def positional_attention(rel: torch.Tensor, pos_proj: nn.Linear) -> torch.Tensor:
    """P_h = softmax_j(v_pos^h . r_ij) for all heads at once: (Nq, Nk, 3) -> (H, Nq, Nk).

    Depends on positions and v_pos only, never on the image, hence no batch dimension.
    Weights below eps / Nk are set to 0 (together they change a row's output by less than float
    rounding): a local head makes many weights tiny or subnormal, and subnormal operands or products
    slow the CPU GEMMs with P (forward and backward) several times over."""
    nq, nk, _ = rel.shape
    logits = pos_proj.weight.float() @ rel.reshape(nq * nk, 3).t()
    if pos_proj.bias is not None:  # cancels in the softmax; kept for exact parity with timm
        logits = logits + pos_proj.bias.float()[:, None]
    attn = logits.view(-1, nq, nk).softmax(dim=-1)
    return attn.masked_fill(attn < torch.finfo(attn.dtype).eps / nk, 0.0)


def _fold(v: torch.Tensor) -> torch.Tensor:
    """(B, H, N, dv) -> (H, N, B*dv); a value shared by heads, (B, 1, N, dv) -> (N, B*dv)."""
    b, hv, n, dv = v.shape
    if hv == 1:
        return v[:, 0].permute(1, 0, 2).reshape(n, b * dv)
    return v.permute(1, 2, 0, 3).reshape(hv, n, b * dv)


def _unfold(folded: torch.Tensor, batch: int) -> torch.Tensor:
    """(H, N, B*dv) -> (B, H, N, dv), a view."""
    h, n, bd = folded.shape
    return folded.view(h, n, batch, bd // batch).permute(2, 0, 1, 3)


def _positional_matmul(pos_attn: torch.Tensor, folded: torch.Tensor) -> torch.Tensor:
    """(H, Nq, Nk) @ folded values -> (H, Nq, B*dv): one GEMM (shared value) or one batched GEMM."""
    if folded.dim() == 2:
        h, nq, nk = pos_attn.shape
        return (pos_attn.reshape(h * nq, nk) @ folded).view(h, nq, -1)
    return torch.bmm(pos_attn, folded)


def apply_positional(pos_attn: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """P @ V with the batch folded into the columns, (H, Nq, Nk) x (B, H|1, Nk, dv) -> (B, H, Nq, dv).

    Differentiable through plain autograd, which forms dP as (H, Nq, Nk) directly (a broadcast
    `P[None] @ v` would build a (B, H, Nq, Nk) gradient instead)."""
    return _unfold(_positional_matmul(pos_attn.to(v.dtype), _fold(v)), v.shape[0])


class _PositionalMix(torch.autograd.Function):
    """lerp(content, P @ V, gate) that saves for backward only what SDPA already keeps alive.

    Neither P @ V nor the folded copy of V is kept: the backward refolds V. The gate's gradient needs
    no second P @ V either: sum_{b,q,d} grad * (P V) = sum_{q,k} P * (grad_folded V_folded^T), and
    that last product is the one dP needs anyway. The output is laid out as (B, Nq, H, dv) so that
    merging the heads afterwards is a view, not a copy."""

    @staticmethod
    def forward(ctx, content, pos_attn, v, gate):
        batch, heads, nq, dv = content.shape
        positional = _unfold(_positional_matmul(pos_attn, _fold(v)), batch)
        out = content.new_empty(batch, nq, heads, dv).transpose(1, 2)
        torch.lerp(content, positional, gate.to(content.dtype).view(1, -1, 1, 1), out=out)
        ctx.save_for_backward(content, pos_attn, v, gate)
        return out

    @staticmethod
    def backward(ctx, grad):
        content, pos_attn, v, gate = ctx.saved_tensors
        heads, nq, _ = pos_attn.shape
        batch = v.shape[0]
        weight = gate.to(grad.dtype)
        folded = _fold(v)
        grad_folded = grad.permute(1, 2, 0, 3).reshape(heads, nq, -1)  # (H, Nq, B*dv), unweighted
        grad_content = grad_pos_attn = grad_v = grad_gate = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[3]:
            keys_t = folded.t() if folded.dim() == 2 else folded.transpose(1, 2)
            grad_scores = grad_folded @ keys_t  # (H, Nq, Nk): dL/dP before the gate's weight
        if ctx.needs_input_grad[0]:
            grad_content = grad * (1 - weight).view(1, -1, 1, 1)
        if ctx.needs_input_grad[1]:
            grad_pos_attn = grad_scores * weight.view(-1, 1, 1)
        if ctx.needs_input_grad[2]:
            weighted_t = (pos_attn * weight.view(-1, 1, 1)).transpose(1, 2)  # (H, Nk, Nq)
            if folded.dim() == 2:  # shared value: sum the heads' contributions in one GEMM
                grad_shared = weighted_t.transpose(0, 1).reshape(-1, heads * nq) @ grad_folded.reshape(heads * nq, -1)
                grad_v = grad_shared.view(-1, batch, v.shape[-1]).permute(1, 0, 2).unsqueeze(1)
            else:
                grad_v = _unfold(torch.bmm(weighted_t, grad_folded), batch)
        if ctx.needs_input_grad[3]:
            accumulate = torch.promote_types(grad.dtype, torch.float32)  # reduce bf16 in fp32
            positional_part = (pos_attn * grad_scores).sum(dim=(1, 2), dtype=accumulate)
            content_part = (grad * content).sum(dim=(0, 2, 3), dtype=accumulate)
            grad_gate = (positional_part - content_part).to(gate.dtype)
        return grad_content, grad_pos_attn, grad_v, grad_gate


def gated_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_attn: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor:
    """(1 - gate_h) softmax(Q K^T / sqrt(d)) V + gate_h P_h V: the GPSA hot path.

    q: (B, H, Nq, d); k: (B, H, Nk, d); v: (B, H, Nk, dv), or (B, 1, Nk, dv) for a value shared by
    all heads; pos_attn: (H, Nq, Nk); gate: (H,) weights in [0, 1]. Returns (B, H, Nq, dv).

    Two schedules give the same result; the cheaper one is picked from the shapes:
    - values narrower than the key count (dv < Nk: a ViT's patch tokens): content through the fused
      SDPA kernel plus the batch-folded positional GEMM; no (B, H, Nq, Nk) tensor exists at all.
    - values at least as wide as the key count (dv >= Nk: a Transformed CNN's late stages, where each
      head's value is the full C_in): the mixed attention (B, H, Nq, Nk) is no larger than the output,
      so it is formed once and applied in one GEMM, instead of multiplying the wide V twice."""
    heads = q.shape[1]
    if v.shape[-1] < k.shape[-2]:
        content = F.scaled_dot_product_attention(q, k, v.expand(-1, heads, -1, -1))
        return _PositionalMix.apply(content, pos_attn.to(v.dtype), v, gate)
    content = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(dim=-1)
    attn = torch.lerp(content, pos_attn.to(content.dtype), gate.to(content.dtype).view(1, heads, 1, 1))
    if v.shape[1] == 1:  # shared value: one GEMM per image over all heads' queries
        b, _, nq, nk = attn.shape
        return (attn.reshape(b, heads * nq, nk) @ v[:, 0]).view(b, heads, nq, -1)
    return attn @ v


def kernel_offsets(num_heads: int) -> torch.Tensor:
    """Centers of attention Delta^h (dx, dy) of the convolutional initialization, shape (H, 2).

    Heads tile a k x k kernel, k = ceil(sqrt(H)), in row-major order (head = row * k + col, the
    order of a conv filter's taps). Offsets run over range(-(k // 2), k - k // 2): symmetric for odd
    k, one more on the negative side for even k (2x2 -> {-1, 0}), so each head has one integer
    target pixel (timm centers even kernels on half-integers, which splits a head over four pixels).
    When H is not a perfect square the H offsets closest to the center are kept, in row-major order."""
    k = math.ceil(math.sqrt(num_heads))
    steps = torch.arange(k, dtype=torch.float32) - k // 2
    dy, dx = torch.meshgrid(steps, steps, indexing="ij")
    offsets = torch.stack([dx.flatten(), dy.flatten()], dim=-1)
    if num_heads < k * k:
        nearest = torch.argsort(offsets.pow(2).sum(-1), stable=True)[:num_heads]
        offsets = offsets[nearest.sort().values]
    return offsets


class GPSA(nn.Module):
    """Gated positional self-attention over a grid of patch tokens (no class token)."""

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

        self.fused = True  # False forces the explicit path (for tests and diagnostics)
        self.gate_override: Optional[float] = None  # test-time mask: 0 = content only, 1 = position only
        self._rel_cache: dict = {}

    # -- pieces ---------------------------------------------------------------------------------
    def gate(self) -> torch.Tensor:
        """Weight on the positional attention per head, sigma(lambda_h) unless overridden."""
        if self.gate_override is not None:
            return torch.full_like(self.gating_param, float(self.gate_override))
        return torch.sigmoid(self.gating_param)

    def relative_encodings(self, grid_size: GridSize, device) -> torch.Tensor:
        key = (tuple(grid_size), str(device))
        if key not in self._rel_cache:
            pos = grid_positions(*grid_size, device=device)
            self._rel_cache = {key: relative_encodings(pos, pos)}  # keep one grid: sizes rarely alternate
        return self._rel_cache[key]

    def positional_attention(self, grid_size: GridSize) -> torch.Tensor:
        """(H, N, N) positional attention for a grid of this size."""
        return positional_attention(self.relative_encodings(grid_size, self.pos_proj.weight.device), self.pos_proj)

    def _qkv(self, x: torch.Tensor):
        """Queries, keys and values from one GEMM: timm's separate `qk` and `v` weights, concatenated."""
        b, n, c = x.shape
        weight = torch.cat([self.qk.weight, self.v.weight])
        bias = None if self.qk.bias is None else torch.cat([self.qk.bias, self.v.bias])
        return F.linear(x, weight, bias).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)

    def attention(self, x: torch.Tensor, grid_size: GridSize) -> torch.Tensor:
        """The explicit, normalized attention matrix A, shape (B, H, N, N) (before dropout)."""
        q, k, _ = self._qkv(x)
        return self._explicit_attention(q, k, grid_size)

    def _explicit_attention(self, q, k, grid_size):
        content = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        gate = self.gate().view(1, -1, 1, 1)
        attn = (1.0 - gate) * content + gate * self.positional_attention(grid_size).to(content.dtype)
        return attn / attn.sum(dim=-1, keepdim=True)

    # -- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, grid_size: GridSize) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self._qkv(x)
        if self.fused and not (self.training and self.attn_drop.p > 0):
            out = gated_attention(q, k, v, self.positional_attention(grid_size), self.gate())
        else:
            out = self.attn_drop(self._explicit_attention(q, k, grid_size)) @ v
        x = out.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(x))

    @torch.no_grad()
    def local_init(self, locality_strength: Optional[float] = None) -> None:
        """Convolutional initialization (Eq. 7.5): W_val = I, v_pos^h = alpha (2 Dx, 2 Dy, -1).

        Then v_pos^h . r = -alpha (|delta - Delta^h|^2 - |Delta^h|^2): head h attends around its
        kernel offset Delta^h, more sharply as alpha grows."""
        alpha = self.locality_strength if locality_strength is None else locality_strength
        self.v.weight.copy_(torch.eye(self.dim))
        offsets = kernel_offsets(self.num_heads)
        self.pos_proj.weight.copy_(alpha * torch.cat([2 * offsets, -torch.ones(self.num_heads, 1)], dim=1))


class MHSA(nn.Module):
    """Multi-head self-attention through PyTorch's fused kernel; explicit maps for diagnostics."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, attn_drop: float = 0.0, proj_drop: float = 0.0):
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

    def attention(self, x: torch.Tensor, grid_size: Optional[GridSize] = None) -> torch.Tensor:
        """The explicit attention matrix, shape (B, H, N, N) (before dropout)."""
        q, k, _ = self._qkv(x)
        return ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)

    def forward(self, x: torch.Tensor, grid_size: Optional[GridSize] = None) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self._qkv(x)
        drop = self.attn_drop.p if self.training else 0.0
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=drop).transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(x))
