"""How far an eFCN is from the CNN subspace (Sec. 6.3.3-6.3.4).

- Locality: delta = ||W_off-local|| / ||W|| over the weights of the embedded conv layers (biases
  and the classifier are excluded: they have no locality constraint). 0 right after embedding.
- Weight sharing: within the local entries, all copies of one filter tap (same out channel, in
  channel and tap, different positions) are equal in a CNN. The violation is the relative distance
  of the local weights to that constraint: ||W_local - mean_tap(W_local)|| / ||W_local||, where
  mean_tap replaces every copy by the mean of its tap's copies (the orthogonal projection onto the
  weight-sharing subspace). 0 right after embedding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .embedding import LocalLinear


def local_layers(model: nn.Module) -> dict[str, LocalLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LocalLinear)}


def _embedded_conv_layers(model: nn.Module) -> dict[str, LocalLinear]:
    """`local_layers`, or a ValueError for a model that has none (not an eFCN)."""
    layers = local_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no embedded conv layers (LocalLinear); build it with efcn.embed")
    return layers


def _short(name: str) -> str:
    return name.removeprefix("layers.")


@torch.no_grad()
def _squared_norms(layer: LocalLinear) -> tuple[float, float]:
    """(||W||^2, ||W_off-local||^2) accumulated in float64, chunked over output channels."""
    total = torch.linalg.vector_norm(layer.weight, dtype=torch.float64).item() ** 2
    off_local = sum(
        torch.linalg.vector_norm(chunk, dtype=torch.float64).item() ** 2
        for _, chunk in layer.masked_weight_chunks("off_local")
    )
    return total, off_local


def deviation(model: nn.Module) -> dict[str, float]:
    """delta per embedded conv layer and "total" (all of them pooled)."""
    layers = _embedded_conv_layers(model)
    result, total, off_local = {}, 0.0, 0.0
    for name, layer in layers.items():
        layer_total, layer_off = _squared_norms(layer)
        result[_short(name)] = math.sqrt(layer_off / layer_total) if layer_total > 0 else 0.0
        total, off_local = total + layer_total, off_local + layer_off
    result["total"] = math.sqrt(off_local / total) if total > 0 else 0.0
    return result


@torch.no_grad()
def weight_sharing_violation(model: nn.Module) -> dict[str, float]:
    """Relative distance of the local weights to the weight-sharing subspace, per layer and "total"."""
    layers = _embedded_conv_layers(model)
    result, total, residual = {}, 0.0, 0.0
    for name, layer in layers.items():
        out_pixel, in_pixel, tap = layer.local_entries()
        values = layer.weight4d()[:, out_pixel, :, in_pixel].double()  # (N, C_out, C_in)
        n_taps = int(tap.max()) + 1
        sums = values.new_zeros(n_taps, *values.shape[1:]).index_add_(0, tap, values)
        counts = torch.bincount(tap, minlength=n_taps).to(values.dtype)
        means = sums / counts.clamp(min=1)[:, None, None]
        layer_total = values.square().sum().item()
        layer_residual = (values - means[tap]).square().sum().item()
        result[_short(name)] = math.sqrt(layer_residual / layer_total) if layer_total > 0 else 0.0
        total, residual = total + layer_total, residual + layer_residual
    result["total"] = math.sqrt(residual / total) if total > 0 else 0.0
    return result


def summary(model: nn.Module, images: torch.Tensor | None = None) -> dict[str, float]:
    """Flat metrics the engine logs each epoch; {} for a model that is not an eFCN.

    `images` is part of the diagnostics contract; these metrics depend on the weights only.
    """
    if not local_layers(model):
        return {}
    metrics = {f"deviation/{k}": v for k, v in deviation(model).items()}
    metrics["weight_sharing/total"] = weight_sharing_violation(model)["total"]
    return metrics
