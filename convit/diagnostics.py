"""Locality diagnostics of attention layers: nonlocality, gating, attention span, attention maps.

These are the quantities of Figs. 7.6-7.8 (ConViT) and 8.4-8.5 (Transformed CNN); the training
engine logs `summary(model, images)` every epoch and `convit.diagnostic_plots` draws them.

Naming. Attention layers are numbered 1, 2, ... in module order (`model.blocks[0].attn` of a ConViT
is `layer1`), heads 1, 2, ... as in the paper's figures. `attention_layers(model)` gives the module
name behind each number.

Which layers. Nonlocality and attention maps need the explicit attention matrix of tokens on a
known grid: they cover this package's `GPSA` and `MHSA` (called as `layer(x, grid_size)`) and timm's
ViT `Attention` (grid from the model's `patch_embed`), so timm's DeiT baselines compare with a ConViT
as in Fig. 7.6. Gating and span only read parameters: they cover any module that has `gating_param`
and `pos_proj` (the GPSA layers of a Transformed CNN too, whatever their input; their query maps
are in `transformed_cnn.diagnostics`).

Class token. Tokens before the patch grid (class / distillation tokens, N - Hp * Wp of them) have no
position. Both their rows (queries) and columns (keys) are dropped, and each query's attention over
the patches is renormalized to sum to 1, so that nonlocality is the mean distance *to the patches a
head looks at*. Without renormalization a head that attends mostly to the class token would look
local (distance 0); with it, SA layers (which see the class token) and GPSA layers (which do not)
are measured on the same footing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from timm.layers import Attention as TimmAttention
from torch import nn

from convbias.gpsa import GridSize, grid_positions

from .attention import GPSA, MHSA

__all__ = [
    "attention_layers",
    "attention_maps",
    "attention_nonlocality",
    "attention_span",
    "default_query",
    "gating",
    "is_gated",
    "nonlocality",
    "patch_distances",
    "query_maps",
    "query_maps_or_none",
    "summary",
]


# -- which modules ------------------------------------------------------------------------------
def is_gated(module: nn.Module) -> bool:
    """A gated positional attention layer: has the per-head gate lambda and the v_pos projection."""
    return isinstance(getattr(module, "gating_param", None), torch.Tensor) and isinstance(
        getattr(module, "pos_proj", None), nn.Linear
    )


def _has_explicit_attention(module: nn.Module) -> bool:
    return isinstance(module, (GPSA, MHSA, TimmAttention))


def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module name, module) of every attention layer, in module order; layer l is entry l - 1."""
    return [(name, m) for name, m in model.named_modules() if is_gated(m) or _has_explicit_attention(m)]


# -- parameters-only diagnostics ----------------------------------------------------------------
@torch.no_grad()
def gating(module: nn.Module) -> torch.Tensor:
    """Weight on positional attention per head, sigma(lambda_h), shape (H,).

    Uses the layer's own `gate()` when it has one (so a test-time `gate_override` shows)."""
    if not is_gated(module):
        raise ValueError(f"{type(module).__name__} has no gating_param/pos_proj: not a gated attention layer")
    gate = getattr(module, "gate", None)
    if callable(gate) and not isinstance(gate, nn.Module):
        return gate().detach().float().cpu()
    return torch.sigmoid(module.gating_param.detach().float()).cpu()


@torch.no_grad()
def attention_span(module: nn.Module) -> torch.Tensor:
    """Attention span 1 / alpha_h per head, shape (H,), with alpha_h = -v_pos^h[2] (Eq. 7.5).

    v_pos^h = alpha_h (2 Dx, 2 Dy, -1) at the convolutional initialization, so the coefficient of
    |delta|^2 is -alpha_h. A negative span means the head's positional attention grows with distance
    (alpha_h < 0); alpha_h = 0 (uniform positional attention) gives an infinite span."""
    if not is_gated(module):
        raise ValueError(f"{type(module).__name__} has no gating_param/pos_proj: not a gated attention layer")
    alpha = -module.pos_proj.weight.detach().float()[:, 2].cpu()
    return 1.0 / alpha


# -- nonlocality (Eq. 7.8) ----------------------------------------------------------------------
def patch_distances(grid_size: GridSize, device=None) -> torch.Tensor:
    """Euclidean distances ||delta_ij|| in patches between the tokens of a grid, shape (N, N)."""
    pos = grid_positions(*grid_size, device=device)
    return torch.cdist(pos, pos)


def _patch_attention(attn: torch.Tensor, grid_size: GridSize) -> torch.Tensor:
    """Patch-to-patch block of an attention matrix (B, H, N, N): leading non-patch tokens dropped,
    rows renormalized. See the module docstring."""
    num_patches = grid_size[0] * grid_size[1]
    extra = attn.shape[-1] - num_patches
    if extra < 0 or attn.shape[-2] != attn.shape[-1]:
        raise ValueError(f"attention of shape {tuple(attn.shape)} does not cover a {grid_size} patch grid")
    if extra == 0:
        return attn
    attn = attn[..., extra:, extra:]
    return attn / attn.sum(dim=-1, keepdim=True)


def attention_nonlocality(attn: torch.Tensor, grid_size: GridSize) -> torch.Tensor:
    """Eq. 7.8 per head: sum_j A_ij ||delta_ij||, averaged over queries i and the batch; (H,).

    attn: (B, H, N, N) with N = Hp * Wp patch tokens, optionally preceded by class tokens."""
    attn = _patch_attention(attn.float(), grid_size)
    dist = patch_distances(grid_size, attn.device)
    return torch.einsum("bhij,ij->h", attn, dist).cpu() / (attn.shape[0] * attn.shape[2])


# -- running the model with hooks ---------------------------------------------------------------
def _timm_attention(module: TimmAttention, x: torch.Tensor) -> torch.Tensor:
    """Explicit softmax(q k^T / sqrt(d)) of timm's ViT attention, whose forward does not return it."""
    b, n, _ = x.shape
    q, k, _ = module.qkv(x).view(b, n, 3, module.num_heads, module.head_dim).permute(2, 0, 3, 1, 4)
    q, k = module.q_norm(q), module.k_norm(k)
    return ((q * module.scale) @ k.transpose(-2, -1)).softmax(dim=-1)


def _call_inputs(module: nn.Module, args: tuple, kwargs: dict, model: nn.Module):
    """(x, grid_size) of one call of an attention layer on patch tokens, or None when the grid of the
    tokens is unknown (the call is then skipped).

    This package's layers receive their grid. For timm's `Attention` the grid is the model's
    `patch_embed.grid_size`, trusted only when the token count is prefix tokens + that grid."""
    x = args[0] if args else kwargs.get("x")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return None
    grid = None
    if isinstance(module, (GPSA, MHSA)):
        grid = args[1] if len(args) > 1 else kwargs.get("grid_size")
    model_grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if grid is None and model_grid is not None:
        prefix = getattr(model, "num_prefix_tokens", 0)
        grid = model_grid if x.shape[1] == prefix + model_grid[0] * model_grid[1] else None
    if grid is None or grid[0] * grid[1] > x.shape[1]:
        return None
    return x, (int(grid[0]), int(grid[1]))


def _explicit_attention(module: nn.Module, x: torch.Tensor, grid: GridSize) -> torch.Tensor:
    if isinstance(module, TimmAttention):
        return _timm_attention(module, x)
    return module.attention(x, grid)


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode and no grad; restores every submodule's own training flag afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


def _attention_statistics(model: nn.Module, images: torch.Tensor, reduce, chunk_size: int) -> dict[int, torch.Tensor]:
    """Mean over images of reduce(A, grid_size) for every attention layer l with an explicit matrix.

    Forwards `images` once in eval mode without gradients; a forward hook computes each layer's
    explicit attention A (b, H, N, N) from the layer's input, `chunk_size` images at a time to bound
    memory, and accumulates reduce(A, grid) (which must sum over its b images). Returns {l: mean}."""
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a (B, C, H, W) tensor, got {shape}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    totals: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}

    def make_hook(layer: int):
        def hook(module, args, kwargs, output):
            inputs = _call_inputs(module, args, kwargs, model)
            if inputs is None:
                return
            x, grid = inputs
            for chunk in x.split(chunk_size):
                value = reduce(_explicit_attention(module, chunk, grid), grid)
                totals[layer] = totals[layer] + value if layer in totals else value
                counts[layer] = counts.get(layer, 0) + chunk.shape[0]

        return hook

    handles = [
        module.register_forward_hook(make_hook(layer), with_kwargs=True)
        for layer, (_, module) in enumerate(attention_layers(model), start=1)
        if _has_explicit_attention(module)
    ]
    if not handles:
        return {}
    device = next(model.parameters()).device
    try:
        with _eval_mode(model):
            model(images.to(device))
    finally:
        for handle in handles:
            handle.remove()
    return {layer: totals[layer] / counts[layer] for layer in totals}


def nonlocality(model: nn.Module, images: torch.Tensor, chunk_size: int = 32) -> dict[int, torch.Tensor]:
    """Nonlocality (Eq. 7.8) per head of every attention layer over a batch of images: {l: (H,)}."""

    def summed_over_images(attn: torch.Tensor, grid: GridSize) -> torch.Tensor:
        return attention_nonlocality(attn, grid) * attn.shape[0]

    return _attention_statistics(model, images, summed_over_images, chunk_size)


def default_query(grid_size: GridSize) -> tuple[int, int]:
    """The query patch (row, col) at the center of the grid, as in Figs. 7.8 and 8.5."""
    return grid_size[0] // 2, grid_size[1] // 2


def attention_maps(
    model: nn.Module, images: torch.Tensor, query: tuple[int, int] | None = None, chunk_size: int = 32
) -> dict[int, torch.Tensor]:
    """Attention of one query patch over the patch grid, per layer and head: {l: (H, Hp, Wp)}.

    `query` is (row, col) on the grid (default: the center). With several images the maps are
    averaged over them (Fig. F.7); pass one image for Fig. 7.8. Class tokens are dropped and each map
    renormalized over the patches (see the module docstring)."""

    def query_row(attn: torch.Tensor, grid: GridSize) -> torch.Tensor:
        row, col = default_query(grid) if query is None else query
        if not (0 <= row < grid[0] and 0 <= col < grid[1]):
            raise ValueError(f"query patch (row, col) = {(row, col)} is outside the {grid[0]}x{grid[1]} patch grid")
        patch_attn = _patch_attention(attn.float(), grid)[:, :, row * grid[1] + col, :]
        return patch_attn.sum(0).view(-1, *grid).cpu()

    return _attention_statistics(model, images, query_row, chunk_size)


def query_maps(
    model: nn.Module, image: torch.Tensor, query: tuple[int, int] | None = None, layers: list[int] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]], dict[str, list[float]]]:
    """What `convbias.evaluation.figures.plot_attention_maps` draws for one (C, H, W) image (Fig. 7.8):
    ({"layer l": (H, Hp, Wp) maps}, {"layer l": query (row, col)}, {"layer l": gates} for gated layers).

    layers: 1-based layer numbers (default: every layer with explicit attention maps)."""
    maps = attention_maps(model, image[None], query=query)
    if not maps:
        raise ValueError(f"{type(model).__name__} has no attention layer with explicit attention maps")
    layers = sorted(maps) if layers is None else list(layers)
    missing = [layer for layer in layers if layer not in maps]
    if missing:
        raise ValueError(f"layers {missing} have no attention maps; available layers: {sorted(maps)}")
    modules = dict(enumerate((m for _, m in attention_layers(model)), start=1))
    labels = {layer: f"layer {layer}" for layer in layers}
    queries = {labels[i]: default_query(tuple(maps[i].shape[1:])) if query is None else tuple(query) for i in layers}
    gates = {labels[i]: gating(modules[i]).tolist() for i in layers if is_gated(modules[i])}
    return {labels[i]: maps[i] for i in layers}, queries, gates


def query_maps_or_none(
    model: nn.Module, image: torch.Tensor, query: tuple[int, int] | None = None, layers: list[int] | None = None
):
    """`query_maps` for a model with explicit attention layers (a ConViT, timm's ViTs), None for any other: the
    family's maps for `convbias-diagnostics --image`, which asks the other families about a model without them."""
    if not any(_has_explicit_attention(module) for _, module in attention_layers(model)):
        return None
    return query_maps(model, image, query=query, layers=layers)


def summary(model: nn.Module, images: torch.Tensor, chunk_size: int = 32) -> dict[str, float]:
    """Flat diagnostics for logging, layers and heads numbered from 1:

    `nonlocality/layer{l}` (mean over heads) and `nonlocality/layer{l}/head{h}` for layers with an
    explicit attention matrix; `gating/layer{l}[/head{h}]` (sigma(lambda_h)) and
    `span/layer{l}[/head{h}]` (1 / alpha_h) for gated layers. {} for a model without attention layers."""
    layers = attention_layers(model)
    if not layers:
        return {}
    out: dict[str, float] = {}

    def add(metric: str, layer: int, per_head: torch.Tensor) -> None:
        out[f"{metric}/layer{layer}"] = float(per_head.mean())
        for head, value in enumerate(per_head.tolist(), start=1):
            out[f"{metric}/layer{layer}/head{head}"] = float(value)

    for layer, per_head in sorted(nonlocality(model, images, chunk_size).items()):
        add("nonlocality", layer, per_head)
    for layer, (_, module) in enumerate(layers, start=1):
        if is_gated(module):
            add("gating", layer, gating(module))
            add("span", layer, attention_span(module))
    return out
