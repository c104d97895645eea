"""Eager's kernels inside a CPU inductor graph, for the ops where inductor's own CPU code loses to eager.

Inductor's generated C++ is slower than ATen's kernels for GELU, LayerNorm, max-pool with indices (a
scalar loop) and the bool mask it saves for ReLU's backward (docs/benchmarks.md has the per-op timings
and docs/hot-path.md the design). Here:

- GELU, LayerNorm: `torch.library.custom_op`s whose forward and backward call ATen's kernels, so
  inductor keeps each as one opaque call inside the graph (no graph break) and fuses what is around it;
- ReLU: inductor compiles the forward, the backward reads the saved output with ATen's kernel, as eager's;
- max-pool over non-overlapping windows: a max over the last axis of a view, which inductor fuses and
  vectorizes both ways (same gradient as ATen's: to the first maximum of a window); other windows go
  through ATen's kernels as a custom op; without autograd, inductor's own (fast) max-pool.

Every op computes exactly what the eager module does (tests/engine/model/test_aten_kernels.py compares bit for bit).
`use_aten_kernels(model)` switches modules of the exact classes nn.GELU, nn.LayerNorm and timm's
LayerNorm (with weight and bias), nn.ReLU and nn.MaxPool2d (without return_indices) to the subclasses
at the bottom (AtenGELU, ...); parameters, buffers, state_dict keys and isinstance checks are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import LayerNorm as TimmLayerNorm
from torch import Tensor, nn


def _aten_op(name: str, fn: Callable) -> Any:
    """`fn` (a call of ATen's kernels) as the opaque op convbias::`name`. Its fake (what inductor traces)
    is `fn` itself on fake tensors, so output shapes and strides are ATen's own."""
    op = torch.library.custom_op(f"convbias::{name}", fn, mutates_args=())
    op.register_fake(fn)
    return op


# ------------------------------------------------------------------ GELU


def _gelu(x: Tensor, approximate: str) -> Tensor:
    return torch.ops.aten.gelu(x, approximate=approximate)


def _gelu_backward(grad: Tensor, x: Tensor, approximate: str) -> Tensor:
    return torch.ops.aten.gelu_backward(grad, x, approximate=approximate)


gelu, gelu_backward = _aten_op("gelu", _gelu), _aten_op("gelu_backward", _gelu_backward)


def _gelu_context(ctx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.approximate = inputs[1]


def _gelu_grad(ctx, grad: Tensor):
    (x,) = ctx.saved_tensors
    return gelu_backward(grad, x, ctx.approximate), None


gelu.register_autograd(_gelu_grad, setup_context=_gelu_context)

# ------------------------------------------------------------------ LayerNorm


def _layer_norm(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.aten.native_layer_norm(x, normalized_shape, weight, bias, eps)


def _layer_norm_backward(
    grad: Tensor, x: Tensor, normalized_shape: Sequence[int], mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    # contiguous inputs (what the CPU kernel makes of them anyway): for a non-contiguous x, ATen's meta
    # function and its CPU kernel disagree on grad_x's strides (torch 2.14)
    return torch.ops.aten.native_layer_norm_backward(
        grad.contiguous(), x.contiguous(), normalized_shape, mean, rstd, weight, bias, [True, True, True]
    )


layer_norm = _aten_op("layer_norm", _layer_norm)
layer_norm_backward = _aten_op("layer_norm_backward", _layer_norm_backward)


def _layer_norm_context(ctx, inputs: tuple, output: tuple) -> None:
    x, normalized_shape, weight, bias, _ = inputs
    ctx.save_for_backward(x, output[1], output[2], weight, bias)
    ctx.normalized_shape = normalized_shape


def _layer_norm_grad(ctx, grad: Tensor, _grad_mean, _grad_rstd):
    x, mean, rstd, weight, bias = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = layer_norm_backward(grad, x, ctx.normalized_shape, mean, rstd, weight, bias)
    return grad_x, None, grad_weight, grad_bias, None


layer_norm.register_autograd(_layer_norm_grad, setup_context=_layer_norm_context)

# ------------------------------------------------------------------ ReLU


def _relu_backward(grad: Tensor, out: Tensor) -> Tensor:
    return torch.ops.aten.threshold_backward(grad, out, 0)


relu_backward = _aten_op("relu_backward", _relu_backward)


class _ReLU(torch.autograd.Function):
    """ReLU whose forward inductor compiles (fused with what comes before it, a BatchNorm say) and whose
    backward reads the saved output with ATen's kernel, as eager's does (left to itself, inductor
    saves a bool mask instead: the slow store of the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        out = torch.relu(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (out,) = ctx.saved_tensors
        return relu_backward(grad, out)


# ------------------------------------------------------------------ max-pool (with autograd)


def _max_pool2d(
    x: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
) -> tuple[Tensor, Tensor]:
    return torch.ops.aten.max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)


def _max_pool2d_backward(
    grad: Tensor,
    x: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    indices: Tensor,
) -> Tensor:
    return torch.ops.aten.max_pool2d_with_indices_backward(
        grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices
    )


max_pool2d = _aten_op("max_pool2d", _max_pool2d)
max_pool2d_backward = _aten_op("max_pool2d_backward", _max_pool2d_backward)


def _max_pool2d_context(ctx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(inputs[0], output[1])
    ctx.args = inputs[1:]


def _max_pool2d_grad(ctx, grad: Tensor, _grad_indices):
    x, indices = ctx.saved_tensors
    return (max_pool2d_backward(grad, x, *ctx.args, indices),) + (None,) * len(ctx.args)


max_pool2d.register_autograd(_max_pool2d_grad, setup_context=_max_pool2d_context)


def _tiled_max_pool2d(x: Tensor, kh: int, kw: int) -> Tensor:
    """Max-pool over non-overlapping kh x kw windows as a max over the last axis of a view. Its autograd
    (the gradient goes to the first maximum of each window, as in ATen's max-pool) and the ReLU before
    it are pointwise for inductor: one fused, vectorized kernel each way, cheaper than ATen's max-pool with
    indices."""
    n, c, h, w = x.shape
    ho, wo = h // kh, w // kw
    windows = x[..., : ho * kh, : wo * kw].reshape(n, c, ho, kh, wo, kw).permute(0, 1, 2, 4, 3, 5)
    return windows.reshape(n, c, ho, wo, kh * kw).max(dim=-1).values


# ------------------------------------------------------------------ modules


def _pair(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value, value]


class AtenGELU(nn.GELU):
    def forward(self, x: Tensor) -> Tensor:
        return gelu(x, self.approximate)


def _layer_norm_forward(self: nn.LayerNorm, x: Tensor) -> Tensor:
    return layer_norm(x, list(self.normalized_shape), self.weight, self.bias, self.eps)[0]


class AtenLayerNorm(nn.LayerNorm):
    forward = _layer_norm_forward


class AtenTimmLayerNorm(TimmLayerNorm):
    forward = _layer_norm_forward


class AtenReLU(nn.ReLU):
    """Never in place: the saved output must stay what the forward returned."""

    def forward(self, x: Tensor) -> Tensor:
        return _ReLU.apply(x)


class AtenMaxPool2d(nn.MaxPool2d):
    def forward(self, x: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):  # no indices needed: inductor's kernel is fast
            return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        kernel, stride = _pair(self.kernel_size), _pair(self.stride if self.stride is not None else self.kernel_size)
        padding, dilation = _pair(self.padding), _pair(self.dilation)
        if stride == kernel and padding == [0, 0] and dilation == [1, 1] and not self.ceil_mode:
            return _tiled_max_pool2d(x, *kernel)
        return max_pool2d(x, kernel, stride, padding, dilation, self.ceil_mode)[0]


# exact classes only: a subclass may compute something else (timm's LayerNorm2d permutes first)
ATEN_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.GELU: AtenGELU,
    nn.LayerNorm: AtenLayerNorm,
    TimmLayerNorm: AtenTimmLayerNorm,
    nn.ReLU: AtenReLU,
    nn.MaxPool2d: AtenMaxPool2d,
}


def _swappable(module: nn.Module) -> bool:
    if isinstance(module, nn.LayerNorm):
        return module.weight is not None and module.bias is not None
    return not getattr(module, "return_indices", False)


def use_aten_kernels(model: nn.Module) -> int:
    """Switch `model`'s modules of the classes in ATEN_CLASSES to the subclass with ATen's kernels (in
    place: parameters, hooks and state_dict keys stay; isinstance of the original class holds; the
    model still pickles). Returns how many were switched; calling it again switches nothing."""
    swapped = 0
    for module in model.modules():
        subclass = ATEN_CLASSES.get(type(module))
        if subclass is not None and _swappable(module):
            module.__class__ = subclass
            swapped += 1
    return swapped
