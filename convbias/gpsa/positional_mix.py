"""The GPSA hot path's positional term as autograd Functions: lerp(content, P @ V, gate) without a
(B, H, N, N) tensor, forward and backward (`convbias.gpsa.gated_attention` picks one).

`PositionalMix` applies the Kronecker-factored P = rows (x) cols axis by axis (two short GEMMs), with the
gate folded into its operands (`convbias.gpsa.GatedFactors`); `DensePositionalMix` applies the dense,
batch-free P (H, N, N) in one GEMM per head (tensor-core shapes). Both fold the batch into the GEMMs'
columns, save no (B, H, N, N) tensor, and lay the output out so that merging the heads is a view.
"""

from __future__ import annotations

import functools

import torch
from einops import rearrange, repeat


def _fold(v: torch.Tensor) -> torch.Tensor:
    """(B, H, N, dv) -> (H, N, B*dv): the batch folded into the columns (one copy, contiguous)."""
    return rearrange(v, "b h n d -> h n (b d)").contiguous()


def _unfold(folded: torch.Tensor, batch: int) -> torch.Tensor:
    """(H, N, B*dv) -> (B, H, N, dv), a view."""
    return rearrange(folded, "h n (b d) -> b h n d", b=batch)


def _per_row(cols: torch.Tensor, rows: int) -> torch.Tensor:
    """(H, Q, K) -> (H*rows, Q, K): the columns factor once per grid row, to batch the GEMMs over rows."""
    return repeat(cols, "h q k -> (h r) q k", r=rows)


def _along_cols(cols: torch.Tensor, folded: torch.Tensor) -> torch.Tensor:
    """cols applied to every key row of V folded as (H*Ky, Kx, B*dv): (H, Ky, Qx*B*dv)."""
    heads = cols.shape[0]
    key_rows = folded.shape[0] // heads
    return torch.bmm(_per_row(cols, key_rows), folded).view(heads, key_rows, -1)


def _accumulation_dtype(tensor: torch.Tensor) -> torch.dtype:
    """fp32 for the reductions of half-precision gradients, their own dtype otherwise (no dispatched
    `torch.promote_types`: it counts as an op)."""
    return torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype


# Split-K for `contract`: chunks of at least this many terms per product (GPU only, see there)
SPLIT_K_MIN_CHUNK = 1024
SPLIT_K_MAX_SPLITS = 256


def _scan_split_count(length: int, device: torch.device) -> int:
    """How many chunks `contract` cuts a contraction of this length into: 1 (no split) off the GPU."""
    if device.type != "cuda":
        return 1
    divisors = [d for d in range(2, SPLIT_K_MAX_SPLITS + 1) if length % d == 0 and length // d >= SPLIT_K_MIN_CHUNK]
    return max(divisors, default=1)


_cached_split_count = functools.lru_cache(maxsize=None)(_scan_split_count)  # a few distinct shapes per model


def split_count(length: int, device: torch.device) -> int:
    """`_scan_split_count`, cached in eager mode (called twice per GPSA layer's backward); Dynamo traces the
    scan itself once per graph (it warns about a cache wrapper it would ignore), as does AOT tracing of a
    backward with dynamic shapes."""
    if torch.compiler.is_compiling() or not isinstance(length, int):  # traced: a symbolic length is unhashable
        return _scan_split_count(length, device)
    return _cached_split_count(length, device)


def contract(a: torch.Tensor, b: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """a @ b^T for a (G, M, K) and b (G, L, K) with a long K and a small M x L output: (G, M, L).

    The backward's products for the factors' gradients have a 14 x 14 output per head and K = B * dv *
    14 terms. A GPU's GEMM gives each output tile one thread block, so there only G blocks walk the
    whole K, a large share of the step (docs/benchmarks.md). Cutting K into
    `splits` chunks gives G * splits blocks (split-K), at the price of a copy of each operand and
    a sum of the partial products (in fp32). The CPU's GEMM needs no help: one chunk there."""
    length = a.shape[-1]
    splits = split_count(length, a.device) if splits is None else splits
    if splits == 1:
        return torch.bmm(a, b.transpose(1, 2))
    a = rearrange(a, "g m (s c) -> (g s) m c", s=splits)
    b = rearrange(b, "g l (s c) -> (g s) l c", s=splits)
    partial = rearrange(torch.bmm(a, b.transpose(1, 2)), "(g s) m l -> g s m l", s=splits)
    return partial.sum(dim=1, dtype=_accumulation_dtype(partial)).to(partial.dtype)


def _mix(content: torch.Tensor, positional: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """lerp(content, P @ V, gate) from P @ V folded as (H, Nq, B*dv): (B, H, Nq, dv), laid out as
    (B, Nq, H, dv) so that merging the heads afterwards is a view, not a copy."""
    batch, heads, nq, dv = content.shape
    weight = gate.to(content.dtype).view(1, -1, 1, 1)
    if torch.compiler.is_compiling():  # Dynamo refuses a non-contiguous out=; inductor picks the layout
        return torch.lerp(content, _unfold(positional, batch), weight)
    out = content.new_empty(batch, nq, heads, dv).transpose(1, 2)
    return torch.lerp(content, _unfold(positional, batch), weight, out=out)


def _gate_grad(
    grad: torch.Tensor, content: torch.Tensor, attention: torch.Tensor, grad_scores: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor:
    """dL/dgate_h = sum G (P V - content) = sum_h attention * dL/d(unweighted attention) - sum G content,
    reduced in fp32 when the gradients are bf16 (attention: P or one of its factors, linear in it)."""
    accumulate = _accumulation_dtype(grad)
    positional_part = (attention * grad_scores).sum(dim=(1, 2), dtype=accumulate)
    content_part = (grad * content).sum(dim=(0, 2, 3), dtype=accumulate)
    return (positional_part - content_part).to(gate.dtype)


class PositionalMix(torch.autograd.Function):
    """(1 - s) content + (s rows (x) cols) @ V, P applied axis by axis, V folded as (H*Ky, Kx, B*dv).

    Inputs: the content term (B, H, Nq, dv), the operands of `convbias.gpsa.GatedFactors` (the rows factor
    already weighted by the gate, the columns factor repeated for every key row, the content's weight 1 - s)
    and V (B, H, Nk, dv). The gate enters through the two weighted operands, so its gradient is autograd's
    on those small tensors: no P @ V is needed for it.

    Forward: along_cols = cols @ V (per key row), then s P @ V = (s rows) @ along_cols, mixed with the
    content in one multiply-add written as (B, Nq, H, dv) (merging the heads afterwards is a view). Saved:
    the folded V and along_cols (two B*N*C tensors per layer); nothing of size N x N exists. Backward:
    S = (s rows)^T G gives dV = cols^T S (per key row) and the repeated columns' gradient S V^T; the
    weighted rows' is G along_cols^T, the content weight's sum G * content (per head, as the diagonal
    blocks of one GEMM over the tokens, so that no B*N*C product is written)."""

    @staticmethod
    def forward(ctx, content, weighted_rows, cols_per_key_row, v, content_weight):
        batch, heads, nq, dv = content.shape
        key_rows, key_cols = weighted_rows.shape[-1], cols_per_key_row.shape[-1]
        width = batch * dv
        folded = _fold(v).view(heads * key_rows, key_cols, width)
        along_cols = torch.bmm(cols_per_key_row, folded).view(heads, key_rows, -1)
        positional = _unfold(torch.bmm(weighted_rows, along_cols).view(heads, nq, width), batch)
        ctx.save_for_backward(content, weighted_rows, cols_per_key_row, folded, along_cols, content_weight)
        weight = content_weight.to(content.dtype).view(1, -1, 1, 1)
        if torch.compiler.is_compiling():  # Dynamo refuses a non-contiguous out=; inductor picks the layout
            return torch.addcmul(positional, content, weight)
        out = torch.empty((batch, nq, heads, dv), dtype=content.dtype, device=content.device).transpose(1, 2)
        return torch.addcmul(positional, content, weight, out=out)

    @staticmethod
    def backward(ctx, grad):
        content, weighted_rows, cols_per_key_row, folded, along_cols, content_weight = ctx.saved_tensors
        heads, query_rows, key_rows = weighted_rows.shape
        query_cols = cols_per_key_row.shape[1]
        batch, width = grad.shape[0], folded.shape[-1]
        grad_content = grad_rows = grad_cols = grad_v = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_content = grad * content_weight.to(grad.dtype).view(1, -1, 1, 1)
        if ctx.needs_input_grad[4]:
            grad_weight = _per_head_dot(grad, content).to(content_weight.dtype)
        grad_folded = _fold(grad).view(heads, query_rows, query_cols * width)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            through_rows = torch.bmm(weighted_rows.transpose(1, 2), grad_folded).view(
                heads * key_rows, query_cols, width
            )
            if ctx.needs_input_grad[2]:
                grad_cols = contract(through_rows, folded)  # (H*Ky, Qx, Kx)
            if ctx.needs_input_grad[3]:
                grad_v = _unfold(
                    torch.bmm(cols_per_key_row.transpose(1, 2), through_rows).view(heads, -1, width), batch
                )
        if ctx.needs_input_grad[1]:
            grad_rows = contract(grad_folded, along_cols)  # (H, Qy, Ky)
        return grad_content, grad_rows, grad_cols, grad_v, grad_weight


def _per_head_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum over (B, N, d) of a * b per head, for (B, H, N, d) tensors: the traces of the heads' (d, d) blocks
    of a^T b over the B*N tokens (one batched GEMM on the tensors as they are laid out, no product written;
    summed in fp32 for half-precision inputs)."""
    batch, heads, n, d = a.shape
    a, b = (t.transpose(1, 2).reshape(batch * n, heads, d).permute(1, 2, 0) for t in (a, b))  # (H, d, B*N)
    blocks = torch.bmm(a, b.transpose(1, 2))  # (H, d, d)
    return blocks.diagonal(dim1=1, dim2=2).sum(dim=-1, dtype=_accumulation_dtype(blocks))


def kronecker_positional_grads(
    grad: torch.Tensor,
    content: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    folded: torch.Tensor,
    gate: torch.Tensor,
    needs: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of lerp(content, (rows (x) cols) @ V, gate) with respect to rows, cols, V (its positional
    term only) and gate, for `needs` = which of those four are wanted (None where not), from the
    output's gradient `grad` (B, H, Nq, dv), the content term and V folded as (H*Ky, Kx, B*dv)."""
    heads, query_rows, key_rows = rows.shape
    _, query_cols, key_cols = cols.shape
    batch, width = grad.shape[0], folded.shape[-1]
    weight = gate.to(grad.dtype).view(-1, 1, 1)
    grad_folded = rearrange(grad, "b h (y x) d -> h y (x b d)", y=query_rows)  # unweighted
    grad_rows = grad_cols = grad_v = grad_gate = None
    if needs[1] or needs[2]:
        # S: (H*Ky, Qx, B*dv), the gradient reaching along_cols, with the gate's weight
        through_rows = torch.bmm((rows * weight).transpose(1, 2), grad_folded).view(heads * key_rows, query_cols, width)
        if needs[1]:
            per_row = contract(through_rows, folded)  # (H*Ky, Qx, Kx)
            grad_cols = per_row.view(heads, key_rows, query_cols, key_cols).sum(dim=1)
        if needs[2]:
            grad_folded_v = torch.bmm(_per_row(cols, key_rows).transpose(1, 2), through_rows)  # (H*Ky, Kx, B*dv)
            grad_v = _unfold(grad_folded_v.view(heads, key_rows * key_cols, width), batch)
    if needs[0] or needs[3]:
        grad_scores = contract(grad_folded, _along_cols(cols, folded))  # (H, Qy, Ky), unweighted
        if needs[0]:
            grad_rows = grad_scores * weight
        if needs[3]:
            grad_gate = _gate_grad(grad, content, rows, grad_scores, gate)
    return grad_rows, grad_cols, grad_v, grad_gate


class DensePositionalMix(torch.autograd.Function):
    """lerp(content, P @ V, gate) with the dense P (H, Nq, Nk) in one GEMM per head, V folded as (H, Nk, B*dv).

    The same function as `PositionalMix`, as GEMMs shaped for tensor cores: Nk terms per output instead
    of Ky and Kx, Nk / (Ky + Kx) times the work. Only the folded V and P are saved. Backward: dV = (s P)^T G
    (one GEMM), dL/dP = s G V^T (one GEMM with K = B*dv terms, split along K on a GPU by `contract`); the
    gate's gradient is sum P * G V^T, the positional term being linear in P."""

    @staticmethod
    def forward(ctx, content, attention, v, gate):
        folded = _fold(v)
        positional = torch.bmm(attention, folded)
        ctx.save_for_backward(content, attention, folded, gate)
        return _mix(content, positional, gate)

    @staticmethod
    def backward(ctx, grad):
        content, attention, folded, gate = ctx.saved_tensors
        weight = gate.to(grad.dtype).view(-1, 1, 1)
        grad_folded = rearrange(grad, "b h n d -> h n (b d)")  # unweighted
        grad_content = grad_attention = grad_v = grad_gate = None
        if ctx.needs_input_grad[0]:
            grad_content = grad * (1 - weight).view(1, -1, 1, 1)
        if ctx.needs_input_grad[2]:
            grad_v = _unfold(torch.bmm((attention * weight).transpose(1, 2), grad_folded), grad.shape[0])
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[3]:
            grad_scores = contract(grad_folded, folded)  # (H, Nq, Nk), unweighted
            if ctx.needs_input_grad[1]:
                grad_attention = grad_scores * weight
            if ctx.needs_input_grad[3]:
                grad_gate = _gate_grad(grad, content, attention, grad_scores, gate)
        return grad_content, grad_attention, grad_v, grad_gate
