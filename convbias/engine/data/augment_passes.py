"""The device augmentation as two passes over the batch per RandAugment layer, every image's op at once.

`augment_histograms` reads the images whose op needs them (Equalize, AutoContrast, Contrast) once for their
channel and gray histograms; `augment_pass` then applies the layer: each image's op from its
plan row (engine.data.rand_augment.layer_plans: none, a level table, an affine warp, equalize, autocontrast
or a blend with gray, smoothed, mean or black), writing uint8, or for the last layer the normalized fp32 batch
with the erased boxes filled. Both are `torch.library.custom_op`s: on CUDA tensors each is one Triton
kernel (engine.data.augment_kernels); on CPU tensors the same kernels under Triton's interpreter when
TRITON_INTERPRET=1 is set when the process starts (how the tests check them), and otherwise the reference:
rand_augment's batched ops, image group by image group (also where Triton is not installed).
"""

from __future__ import annotations

import os

import torch

from .rand_augment import OPS, Kind, OpContext, _apply_lut, _gray, _warp, erase

try:
    from . import augment_kernels
except ImportError:  # torch without Triton (a CPU build): the reference runs
    augment_kernels = None

ERASE_MODES = ("none", "pixel", "rand", "const")  # augment_kernels' ERASE_* codes, in order
GPU_BLOCK, INTERPRETER_BLOCK = 1024, 64  # pixels per program


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _use_kernel(images: torch.Tensor) -> bool:
    on_device = images.device.type == "cuda" or (images.device.type == "cpu" and _interpreting())
    return on_device and augment_kernels is not None


def _grid(images: torch.Tensor) -> tuple[tuple[int, int], dict]:
    n, channels, height, width = images.shape
    block = INTERPRETER_BLOCK if images.device.type == "cpu" else GPU_BLOCK
    channel_block = 1 << (channels - 1).bit_length()
    return (n, -(-height * width // block)), dict(C=channels, CP=channel_block, BLOCK=block)


STATISTICS = (Kind.EQUALIZE, Kind.AUTOCONTRAST, Kind.BLEND_MEAN)  # the kinds that read the histograms


@torch.library.custom_op("convbias::augment_histograms", mutates_args=())
def augment_histograms(images: torch.Tensor, plans: torch.Tensor) -> torch.Tensor:
    """uint8 (N, C, H, W) -> int32 (N, C + 1, 256): each channel's level counts, then Pillow's gray levels', for
    the images whose plan row (N, PLAN_WIDTH) is of a kind in STATISTICS; zeros for the others."""
    n, channels, height, width = images.shape
    hist = torch.zeros((n, channels + 1, 256), dtype=torch.int32, device=images.device)
    if _use_kernel(images):
        grid, sizes = _grid(images)
        augment_kernels.histogram_kernel[grid](images, plans, hist, height * width, **sizes)
        return hist
    rows = torch.isin(plans[:, 0].long(), torch.tensor(STATISTICS)).nonzero().flatten()
    selected = images[rows]
    levels = torch.cat([selected, _gray(selected.float()).to(torch.uint8)], 1).flatten(2)
    hist[rows] = hist[rows].scatter_add_(2, levels.long(), torch.ones_like(levels, dtype=torch.int32))
    return hist


@augment_histograms.register_fake
def _(images, plans):
    return images.new_empty((images.shape[0], images.shape[1] + 1, 256), dtype=torch.int32)


@torch.library.custom_op("convbias::augment_pass", mutates_args=())
def augment_pass(
    images: torch.Tensor,
    plans: torch.Tensor,
    tables: torch.Tensor,
    histograms: torch.Tensor,
    cumulative: torch.Tensor,
    boxes: torch.Tensor,
    noise: torch.Tensor,
    fill: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    interpolation: str,
    final: bool,
    erasing: str,
) -> torch.Tensor:
    """One RandAugment layer on uint8 (N, C, H, W): plans (N, PLAN_WIDTH) and tables (N, 256) fp64 (layer_plans),
    histograms and their running sums along the levels (augment_histograms). uint8 out, or when `final`
    normalized fp32 with the boxes ((N, 5) fp64: top, left, height, width, first noise index) filled by
    `erasing` (ERASE_MODES) from `noise` (rand_augment.erasing_noise)."""
    if _use_kernel(images):
        height, width = images.shape[-2:]
        out = torch.empty_like(images, dtype=torch.float32 if final else torch.uint8)
        grid, sizes = _grid(images)
        augment_kernels.pass_kernel[grid](
            images, out, plans, tables, histograms, cumulative, boxes, noise, fill, mean, std, height, width,
            BICUBIC=interpolation == "bicubic", FINAL=final, ERASE=ERASE_MODES.index(erasing), enable_fp_fusion=False,
            **sizes,
        )  # fmt: skip
        return out
    return _reference_pass(images, plans, tables, boxes, noise, fill, mean, std, interpolation, final, erasing)


@augment_pass.register_fake
def _(images, plans, tables, histograms, cumulative, boxes, noise, fill, mean, std, interpolation, final, erasing):
    return torch.empty_like(images, dtype=torch.float32 if final else torch.uint8)


def _lut(images, plans, tables, ctx):
    return _apply_lut(images, tables[:, None].expand(-1, images.shape[1], -1))


# each kind by rand_augment's batched ops (its blends' factor in the plan's column 1, the warp's coefficients
# in columns 2..7)
REFERENCE = {
    Kind.LUT: _lut,
    Kind.WARP: lambda images, plans, tables, ctx: _warp(images, plans[:, 2:].view(-1, 2, 3), ctx),
    Kind.EQUALIZE: lambda images, plans, tables, ctx: OPS["Equalize"](images, None, ctx),
    Kind.AUTOCONTRAST: lambda images, plans, tables, ctx: OPS["AutoContrast"](images, None, ctx),
    **{
        kind: lambda images, plans, tables, ctx, _op=OPS[name]: _op(images, plans[:, 1].float(), ctx)
        for kind, name in [
            (Kind.BLEND_GRAY, "Color"),
            (Kind.BLEND_SMOOTH, "Sharpness"),
            (Kind.BLEND_MEAN, "Contrast"),
            (Kind.BLEND_ZERO, "Brightness"),
        ]
    },
}


def _reference_pass(images, plans, tables, boxes, noise, fill, mean, std, interpolation, final, erasing):
    """augment_pass in rand_augment's batched ops, one call per kind on the images of that kind."""
    out = images.float()
    ctx = OpContext(fill.view(1, -1, 1, 1), interpolation)
    kinds = plans[:, 0].long()
    for kind, apply in REFERENCE.items():
        rows = (kinds == kind).nonzero().flatten()
        if len(rows):  # each image in one kind: its rows are read before they are written
            out[rows] = apply(out[rows], plans[rows], tables[rows], ctx)
    if not final:
        return out.to(torch.uint8)
    out = out.div_(255.0).sub_(mean.view(1, -1, 1, 1)).div_(std.view(1, -1, 1, 1))
    return out if erasing == "none" else erase(out, boxes[:, :4].long(), erasing, noise)
