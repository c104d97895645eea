"""Attention maps of one query pixel in every GPSA layer of a Transformed CNN (Fig. 8.5).

`convbias.evaluation.figures.plot_attention_maps` draws them. Per-head attention span 1/alpha_h and
gating sigma(lambda_h) over training (Fig. 8.4) are logged with the other attention diagnostics
(`convit.diagnostics.summary` reads `pos_proj` and `gating_param` of any gated layer).
"""

from __future__ import annotations

import torch
from torch import nn

from .transform import gpsa_layers


@torch.no_grad()
def query_attention_maps(
    model: nn.Module, images: torch.Tensor, query: tuple[float, float] = (0.5, 0.5)
) -> dict[str, torch.Tensor]:
    """Attention of the query pixel at relative position `query` = (row, col) in [0, 1) of each
    layer's output grid (default: the center), over that layer's input map.

    Returns {layer name: (B, heads, H_in, W_in)}, the explicit normalized attention (content and
    positional mixed by the gates); the mass on zero-padding tokens is left out of the map."""
    if not all(0.0 <= q < 1.0 for q in query):
        raise ValueError(f"query must be a relative (row, col) position in [0, 1), got {query}")
    layers = gpsa_layers(model)
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(lambda _, args, name=name: inputs.__setitem__(name, args[0]))
        for name, layer in layers.items()
    ]
    was_training = model.training
    try:
        model.eval()
        model(images)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()

    maps = {}
    for name, layer in layers.items():
        x = inputs[name]
        height, width = x.shape[-2:]
        out_h, out_w = layer.output_size(height, width)
        row, col = int(query[0] * out_h), int(query[1] * out_w)
        attn = layer.attention(x)[:, :, row * out_w + col]  # (B, heads, N_k) over the padded grid
        pad_h, pad_w = layer.padding
        padded = attn.view(*attn.shape[:2], height + 2 * pad_h, width + 2 * pad_w)
        maps[name] = padded[..., pad_h : pad_h + height, pad_w : pad_w + width]
    return maps


def query_maps(
    model: nn.Module, image: torch.Tensor, query: tuple[float, float] = (0.5, 0.5)
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[float, float]], dict[str, list[float]]]:
    """What `convbias.evaluation.figures.plot_attention_maps` draws for one (C, H, W) image (Fig. 8.5):
    ({layer: (heads, H_in, W_in) maps}, {layer: query (row, col) on that map}, {layer: gates})."""
    maps = {name: attn[0] for name, attn in query_attention_maps(model, image.unsqueeze(0), query).items()}
    layers = gpsa_layers(model)
    queries = {name: (query[0] * m.shape[-2], query[1] * m.shape[-1]) for name, m in maps.items()}
    gates = {name: layers[name].gate().tolist() for name in maps}
    return maps, queries, gates


def query_maps_or_none(model: nn.Module, image: torch.Tensor, query=None, layers=None):
    """`query_maps` of the center pixel for a Transformed CNN, None for a model without GPSA convolutions: the
    family's maps for `convbias-diagnostics --image`. `query` and `layers` pick a patch and layers of a ViT's
    grid, which a T-CNN's layers (each on its own map) do not share: they are not used."""
    return query_maps(model, image) if gpsa_layers(model) else None
