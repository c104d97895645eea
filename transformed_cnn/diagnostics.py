"""Attention maps of one query pixel in every GPSA layer of a Transformed CNN (Fig. 8.5).

Per-head attention span 1/alpha_h and gating sigma(lambda_h) over training (Fig. 8.4) are logged by
`convit.diagnostics.summary`, which reads `pos_proj` and `gating_param` of any layer.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn

from .transform import gpsa_layers


@torch.no_grad()
def query_attention_maps(
    model: nn.Module, images: torch.Tensor, query: Tuple[float, float] = (0.5, 0.5)
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


def plot_query_attention_maps(model: nn.Module, image: torch.Tensor, query: Tuple[float, float] = (0.5, 0.5)):
    """Figure like Fig. 8.5 for one normalized (C, H, W) image: the image with the query marked, then
    one row per GPSA layer and one column per head, each titled with sigma(lambda_h) in red.
    Returns a matplotlib Figure (`fig.savefig('maps.png')`)."""
    from matplotlib.figure import Figure

    maps = query_attention_maps(model, image.unsqueeze(0), query)
    layers = gpsa_layers(model)
    heads = max(layer.num_heads for layer in layers.values())
    fig = Figure(figsize=(1.6 * (heads + 1), 1.7 * len(maps)), layout="constrained")
    axes = fig.subplots(len(maps), heads + 1, squeeze=False)
    shown = image.detach().float().cpu()
    shown = ((shown - shown.amin()) / (shown.amax() - shown.amin()).clamp_min(1e-12)).permute(1, 2, 0).squeeze(-1)
    for row, (name, attn) in enumerate(maps.items()):
        gates = layers[name].gate().tolist()
        for ax, picture, height, width in [(axes[row, 0], shown, *image.shape[-2:])] + [
            (axes[row, head + 1], attn[0, head].float().cpu(), *attn.shape[-2:]) for head in range(attn.shape[1])
        ]:
            ax.imshow(picture.numpy(), cmap="viridis")
            ax.plot(query[1] * width - 0.5, query[0] * height - 0.5, "s", mfc="none", mec="red", ms=6)
        for head in range(heads):
            axes[row, head + 1].set_title(f"{gates[head]:.2f}" if head < len(gates) else "", color="red", fontsize=8)
        axes[row, 0].set_title(name, fontsize=8)
        for ax in axes[row]:
            ax.axis("off")
    return fig
