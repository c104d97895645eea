"""The GPSA hot path as one Triton kernel: content and positional attention in one pass over the keys.

For head h with gate s_h, content attention C = softmax(Q K^T / sqrt(d)) and positional attention
P_h = rows_h (x) cols_h (`convbias.gpsa.PositionalFactors`),

    out = (1 - s_h) C V + s_h P_h V.

Forward (`_forward_kernel`): one program per (image, head, block of queries) walks the keys block by
block, computing the content scores with an online softmax (running max and sum, as flash attention)
and, for the same key block, the tile P[i, j] = rows[i // Qx, j // Kx] * cols[i % Qx, j % Kx] built from
the two small factors (no (H, N, N) matrix exists), accumulating C V and P V side by side; the gated
output is written once. It also writes the content term C V and the rows' log-sum-exp (B, H, Nq): the
backward's only saved activations besides Q, K, V.

Backward: `_key_grad_kernel` (one program per key block: dK and the content part of dV, over all
query blocks) and `_query_grad_kernel` (one program per query block: dQ), recomputing C from Q, K and
the log-sum-exp, with delta_i = sum(dO_i * (C V)_i) formed beforehand. The positional gradients (its
part of dV, d rows, d cols, d gate) are a separate reduction over the batch with the batch folded into
the GEMMs' columns, the Kronecker product's own (`convbias.gpsa.positional_mix.kronecker_positional_grads`).

The kernels are `torch.library.custom_op`s (`convbias::gpsa_fused_attention` and its backward) with
fake implementations and a registered autograd formula, so `torch.compile(fullgraph=True)` traces
them without a graph break. On CUDA tensors they run the compiled Triton kernels; on CPU tensors they
run the same kernels under Triton's interpreter when `TRITON_INTERPRET=1` is set (how the tests check
the kernels), and otherwise `_reference_forward` / `_reference_backward`, the same math in PyTorch
ops (it forms the (B, H, Nq, Nk) attention: a reference, not a fast path).

Only long-standing Triton language features are used (`tl.dot`, masked `tl.load`/`tl.store`,
`tl.program_id`), block sizes powers of two >= 16 with masks for any token count.
"""

from __future__ import annotations

import math
import os

import torch

from .positional_mix import _fold, kronecker_positional_grads

# Widest query/key head and value per head the kernels take (block widths: powers of two, <= this).
# Two (BLOCK_M, value) fp32 accumulators live in registers; wider values fall back to the unfused path.
FUSED_MAX_HEAD_DIM = 128
FUSED_MAX_VALUE_WIDTH = 128
# Token block sizes: GPU (tensor-core tiles) and Triton's interpreter (numpy per block: small is fast).
GPU_BLOCK_M, GPU_BLOCK_N = 64, 64
# Warps per program on a GPU: 4, or 8 once a value block is wider than this (two fp32 accumulators of
# BLOCK_M x BLOCK_DV per program: more threads keep them in registers)
GPU_WIDE_VALUE_BLOCK = 64
INTERPRETER_BLOCK = 32
MIN_BLOCK = 16  # tl.dot's smallest tile side


def supports(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused kernel takes these shapes: head and value widths up to FUSED_MAX_* (wider
    values, as a Transformed CNN's late stages have, take the unfused schedules)."""
    return q.shape[-1] <= FUSED_MAX_HEAD_DIM and v.shape[-1] <= FUSED_MAX_VALUE_WIDTH


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


_KERNELS: dict[bool, tuple] = {}


def _kernels():
    """(forward, key-gradient, query-gradient) kernels for the current TRITON_INTERPRET setting, decorated
    on first use: `triton.jit` reads the setting when it decorates (the interpreter's and the compiler's
    versions are kept apart)."""
    interpret = _interpreting()
    if interpret not in _KERNELS:
        import triton
        import triton.language as tl

        from . import fused_kernels as source

        if interpret and type(tl.zeros).__name__ != "InterpretedFunction":
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton was imported: Triton's interpreter needs it in the "
                "environment before the process imports torch or triton"
            )

        _KERNELS[interpret] = tuple(
            triton.jit(kernel) for kernel in (source.forward_kernel, source.key_grad_kernel, source.query_grad_kernel)
        )
    return _KERNELS[interpret]


def _launch_config(q: torch.Tensor, v: torch.Tensor) -> dict:
    """Block sizes and the dot products' operand type. fp32 operands multiply in full fp32 (no TF32),
    like torch's default. bf16/fp16 operands multiply in their type with fp32 accumulation on a GPU;
    Triton's interpreter gets them converted to fp32 first (its `tl.dot` mishandles bf16), which is
    the same arithmetic: a product of two bf16 numbers is exact in fp32, accumulated in fp32."""
    import triton.language as tl

    interpreted = q.device.type == "cpu"
    block = INTERPRETER_BLOCK if interpreted else None
    dot_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(q.dtype, tl.float32)
    if interpreted:
        dot_dtype = tl.float32
    return {
        "BLOCK_M": block or GPU_BLOCK_M,
        "BLOCK_N": block or GPU_BLOCK_N,
        "BLOCK_D": max(MIN_BLOCK, 1 << (q.shape[-1] - 1).bit_length()),
        "BLOCK_DV": max(MIN_BLOCK, 1 << (v.shape[-1] - 1).bit_length()),
        "PRECISION": "ieee" if dot_dtype == tl.float32 else "tf32",
        "DOT_DTYPE": dot_dtype,
        "num_warps": 8 if v.shape[-1] > GPU_WIDE_VALUE_BLOCK and not interpreted else 4,
    }


def _use_kernel(q: torch.Tensor) -> bool:
    return q.device.type == "cuda" or (q.device.type == "cpu" and _interpreting())


# -- reference implementation: the same math in PyTorch ops (CPU without the interpreter) --------------


def _dense_positional(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    heads, qy, ky = rows.shape
    _, qx, kx = cols.shape
    return (rows[:, :, None, :, None] * cols[:, None, :, None, :]).reshape(heads, qy * qx, ky * kx)


def _content_probs(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
    return torch.exp(scores - lse[..., None])


def _reference_forward(q, k, v, rows, cols, gate):
    scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1)
    values = v.float()
    content = torch.exp(scores - lse[..., None]) @ values
    positional = _dense_positional(rows.float(), cols.float()) @ values
    weight = gate.float().view(1, -1, 1, 1)
    out = (1 - weight) * content + weight * positional
    return out.to(v.dtype), content.to(v.dtype), lse


def _reference_backward(grad, q, k, v, gate, content, lse):
    probs = _content_probs(q, k, lse)
    content_weight = (1 - gate.float()).view(1, -1, 1, 1)
    grad = grad.float()
    delta = (grad * content.float()).sum(-1, keepdim=True)
    grad_v = content_weight * (probs.transpose(-2, -1) @ grad)
    grad_scores = probs * content_weight * (grad @ v.float().transpose(-2, -1) - delta)
    scale = q.shape[-1] ** -0.5
    grad_q = grad_scores @ k.float() * scale
    grad_k = grad_scores.transpose(-2, -1) @ q.float() * scale
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


# -- the custom ops -------------------------------------------------------------------------------


@torch.library.custom_op("convbias::gpsa_fused_attention", mutates_args=())
def gpsa_fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, gate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, content term, log-sum-exp): out = (1 - gate) softmax(Q K^T / sqrt(d)) V + gate (rows (x) cols) V.

    q: (B, H, Nq, d); k: (B, H, Nk, d); v: (B, H or 1, Nk, dv); rows: (H, Qy, Ky); cols: (H, Qx, Kx)
    with Nq = Qy * Qx, Nk = Ky * Kx; gate: (H,). out and content (B, H, Nq, dv) in v's dtype, lse
    (B, H, Nq) in fp32."""
    if not _use_kernel(q):
        with torch.autocast(q.device.type, enabled=False):  # its fp32 math stays fp32 under autocast
            return _reference_forward(q, k, v, rows, cols, gate)
    q, k, v, rows, cols = (t.contiguous() for t in (q, k, v, rows, cols))
    gate = gate.float().contiguous()
    batch, heads, nq, dim = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    out = v.new_empty(batch, heads, nq, dv)
    content = torch.empty_like(out)
    lse = q.new_empty(batch, heads, nq, dtype=torch.float32)
    forward, _, _ = _kernels()
    config = _launch_config(q, v)
    grid = (math.ceil(nq / config["BLOCK_M"]), batch * heads)
    forward[grid](
        q, k, v, rows, cols, gate, out, content, lse,
        heads, nq, nk, dim, dv, v.shape[1], cols.shape[1], cols.shape[2], rows.shape[1], rows.shape[2],
        dim**-0.5, **config,
    )  # fmt: skip
    return out, content, lse


@gpsa_fused_attention.register_fake
def _(q, k, v, rows, cols, gate):
    batch, heads, nq, _ = q.shape
    out = v.new_empty(batch, heads, nq, v.shape[-1])
    return out, torch.empty_like(out), q.new_empty(batch, heads, nq, dtype=torch.float32)


@torch.library.custom_op("convbias::gpsa_fused_attention_backward", mutates_args=())
def gpsa_fused_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor,
    content: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The content term's gradients (dQ, dK, dV per head (B, H, Nk, dv)) from the output's gradient."""
    if not _use_kernel(q):
        with torch.autocast(q.device.type, enabled=False):
            return _reference_backward(grad, q, k, v, gate, content, lse)
    grad, q, k, v = (t.contiguous() for t in (grad, q, k, v))
    gate = gate.float().contiguous()
    batch, heads, nq, dim = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    delta = (grad.float() * content.float()).sum(-1).contiguous()  # (B, H, Nq)
    grad_q, grad_k = torch.empty_like(q), torch.empty_like(k)
    grad_v = v.new_empty(batch, heads, nk, dv)
    _, key_grads, query_grads = _kernels()
    config = _launch_config(q, v)
    shape_args = (heads, nq, nk, dim, dv, v.shape[1], dim**-0.5)
    key_grads[(math.ceil(nk / config["BLOCK_N"]), batch * heads)](
        q, k, v, gate, grad, lse, delta, grad_k, grad_v, *shape_args, **config
    )
    query_grads[(math.ceil(nq / config["BLOCK_M"]), batch * heads)](
        q, k, v, gate, grad, lse, delta, grad_q, *shape_args, **config
    )
    return grad_q, grad_k, grad_v


@gpsa_fused_attention_backward.register_fake
def _(grad, q, k, v, gate, content, lse):
    """Contiguous, as both real paths return them, whatever the strides of q and k (a permuted qkv)."""
    batch, heads, _, _ = q.shape
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(batch, heads, k.shape[2], v.shape[-1])


def _setup_context(ctx, inputs, output):
    q, k, v, rows, cols, gate = inputs
    _, content, lse = output
    ctx.save_for_backward(q, k, v, rows, cols, gate, content, lse)


def _backward(ctx, grad, _grad_content, _grad_lse):
    q, k, v, rows, cols, gate, content, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v = gpsa_fused_attention_backward(grad, q, k, v, gate, content, lse)
    heads = q.shape[1]
    folded = _fold(v.expand(-1, heads, -1, -1)).reshape(heads * rows.shape[-1], cols.shape[-1], -1)
    needs = ctx.needs_input_grad[3], ctx.needs_input_grad[4], ctx.needs_input_grad[2], ctx.needs_input_grad[5]
    grad_rows, grad_cols, grad_v_positional, grad_gate = kronecker_positional_grads(
        grad, content, rows.to(grad.dtype), cols.to(grad.dtype), folded, gate, needs
    )
    grad_rows, grad_cols = (None if g is None else g.to(f.dtype) for g, f in ((grad_rows, rows), (grad_cols, cols)))
    if grad_v_positional is not None:
        grad_v = grad_v + grad_v_positional
    if v.shape[1] == 1 and heads > 1:  # a value shared by the heads
        grad_v = grad_v.sum(dim=1, keepdim=True)
    return grad_q, grad_k, grad_v, grad_rows, grad_cols, grad_gate


gpsa_fused_attention.register_autograd(_backward, setup_context=_setup_context)


def fused_gated_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor:
    """(1 - gate_h) softmax(Q K^T / sqrt(d)) V + gate_h (rows_h (x) cols_h) V through the fused kernel,
    (B, H, Nq, dv); shapes as `gpsa_fused_attention`'s (`supports` says which widths it takes)."""
    return gpsa_fused_attention(q, k, v, rows, cols, gate)[0]
