"""GPSA layers for the attention tests (a plain module, imported by test files and by the fused kernel
tests' child process)."""

import torch

from convit import GPSA


def randomized_gpsa(dim: int, heads: int, seed: int = 0) -> GPSA:
    """A GPSA with random (not convolutional) positional weights and distinct gates per head."""
    torch.manual_seed(seed)
    layer = GPSA(dim, heads)
    with torch.no_grad():
        layer.pos_proj.weight.normal_()
        layer.pos_proj.bias.normal_()
        layer.gating_param.copy_(torch.linspace(-2.0, 2.0, heads))
    return layer
