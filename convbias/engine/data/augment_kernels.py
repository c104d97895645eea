"""Triton kernels of the device augmentation's passes (engine.data.augment_passes). `triton.jit` reads
TRITON_INTERPRET when it decorates, at import: the tests' interpreter runs in a process started with it set.

One program per (image, block of pixels), all channels at once; the image's plan row (engine.data.rand_augment's
Kind, factor, affine coefficients) picks what it does. The arithmetic is the reference's (augment_passes,
rand_augment's ops) step for step: integer ops where Pillow's are exact, fp32 blends and fp64 autocontrast,
correctly rounded divisions, no fused multiply-add (launched with enable_fp_fusion=False).
"""

import triton
import triton.language as tl

from .rand_augment import GRAY_WEIGHTS, PLAN_WIDTH, Kind

NONE = tl.constexpr(int(Kind.NONE))
LUT = tl.constexpr(int(Kind.LUT))
WARP = tl.constexpr(int(Kind.WARP))
EQUALIZE = tl.constexpr(int(Kind.EQUALIZE))
AUTOCONTRAST = tl.constexpr(int(Kind.AUTOCONTRAST))
BLEND_GRAY = tl.constexpr(int(Kind.BLEND_GRAY))
BLEND_SMOOTH = tl.constexpr(int(Kind.BLEND_SMOOTH))
BLEND_MEAN = tl.constexpr(int(Kind.BLEND_MEAN))
ROW = tl.constexpr(PLAN_WIDTH)
RED, GREEN, BLUE = (tl.constexpr(w) for w in GRAY_WEIGHTS)
CUBIC_A = tl.constexpr(-0.75)  # grid_sample's bicubic (Keys)
# erasing modes (augment_passes.ERASE_MODES' order)
ERASE_PIXEL, ERASE_RAND, ERASE_CONST = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


@triton.jit
def _gray(values, channels, C: tl.constexpr):
    """Pillow's L of (CP, BLOCK) int32 channels: (19595 R + 38470 G + 7471 B + 2**15) >> 16; one channel: itself."""
    if C == 1:
        return tl.sum(tl.where(channels[:, None] == 0, values, 0), 0)
    weights = tl.where(channels == 0, RED, tl.where(channels == 1, GREEN, tl.where(channels == 2, BLUE, 0)))
    return (tl.sum(values * weights[:, None], 0) + 32768) >> 16


@triton.jit
def histogram_kernel(images_ptr, plan_ptr, hist_ptr, HW, C: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr):
    """hist (N, C + 1, 256) int32, zeroed: each channel's levels, then the gray levels', of the images whose
    plan row needs them (equalize, autocontrast, contrast)."""
    n = tl.program_id(0)
    kind = tl.load(plan_ptr + n * ROW).to(tl.int32)
    if (kind != EQUALIZE) & (kind != AUTOCONTRAST) & (kind != BLEND_MEAN):
        return
    pixels = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = pixels < HW
    channels = tl.arange(0, CP)
    mask = (channels[:, None] < C) & valid[None, :]
    values = tl.load(images_ptr + n * C * HW + channels[:, None] * HW + pixels[None, :], mask=mask, other=0)
    values = values.to(tl.int32)
    bins = tl.arange(0, CP * 256)
    binned = tl.reshape(values + channels[:, None] * 256, [CP * BLOCK])
    counts = tl.histogram(binned, CP * 256, mask=tl.reshape(mask, [CP * BLOCK]))
    tl.atomic_add(hist_ptr + n * (C + 1) * 256 + bins, counts, mask=bins < C * 256)
    gray_counts = tl.histogram(_gray(values, channels, C), 256, mask=valid)
    tl.atomic_add(hist_ptr + (n * (C + 1) + C) * 256 + tl.arange(0, 256), gray_counts)


@triton.jit
def _cubic_weights(t):
    """grid_sample's bicubic coefficients for the four taps around a fraction t."""
    near, far = 1.0 + t, 2.0 - t
    w0 = ((CUBIC_A * near - 5.0 * CUBIC_A) * near + 8.0 * CUBIC_A) * near - 4.0 * CUBIC_A
    w1 = ((CUBIC_A + 2.0) * t - (CUBIC_A + 3.0)) * t * t + 1.0
    w2 = ((CUBIC_A + 2.0) * (1.0 - t) - (CUBIC_A + 3.0)) * (1.0 - t) * (1.0 - t) + 1.0
    w3 = ((CUBIC_A * far - 5.0 * CUBIC_A) * far + 8.0 * CUBIC_A) * far - 4.0 * CUBIC_A
    return w0, w1, w2, w3


@triton.jit
def _tap(image, channel_offsets, mask, row, col, H, W):
    """(CP, BLOCK) fp32 pixels at (row, col), clamped to the image (grid_sample's border padding)."""
    row = tl.minimum(tl.maximum(row, 0), H - 1)
    col = tl.minimum(tl.maximum(col, 0), W - 1)
    return tl.load(image + channel_offsets + (row * W + col)[None, :], mask=mask, other=0).to(tl.float32)


@triton.jit
def _cubic_row(image, channel_offsets, mask, row, col, wx0, wx1, wx2, wx3, H, W):
    t0 = _tap(image, channel_offsets, mask, row, col - 1, H, W)
    t1 = _tap(image, channel_offsets, mask, row, col, H, W)
    t2 = _tap(image, channel_offsets, mask, row, col + 1, H, W)
    t3 = _tap(image, channel_offsets, mask, row, col + 2, H, W)
    return t0 * wx0[None, :] + t1 * wx1[None, :] + t2 * wx2[None, :] + t3 * wx3[None, :]


@triton.jit
def _warp(image, plan, fill_ptr, channels, channel_offsets, mask, x, y, H, W, C: tl.constexpr, BICUBIC: tl.constexpr):
    """Pillow's affine transform as rand_augment._warp samples it: output pixel centre -> input point by the
    plan's coefficients; outside the image: the fill color; inside: grid_sample's taps, rounded."""
    a, b, c = tl.load(plan + 2).to(tl.float32), tl.load(plan + 3).to(tl.float32), tl.load(plan + 4).to(tl.float32)
    d, e, f = tl.load(plan + 5).to(tl.float32), tl.load(plan + 6).to(tl.float32), tl.load(plan + 7).to(tl.float32)
    cx, cy = x.to(tl.float32) + 0.5, y.to(tl.float32) + 0.5
    u = a * cx + b * cy + c
    v = d * cx + e * cy + f
    inside = (u >= 0) & (u < W) & (v >= 0) & (v < H)
    ix, iy = u - 0.5, v - 0.5
    if BICUBIC:
        col, row = tl.floor(ix), tl.floor(iy)
        wx0, wx1, wx2, wx3 = _cubic_weights(ix - col)
        wy0, wy1, wy2, wy3 = _cubic_weights(iy - row)
        col, row = col.to(tl.int32), row.to(tl.int32)
        r0 = _cubic_row(image, channel_offsets, mask, row - 1, col, wx0, wx1, wx2, wx3, H, W)
        r1 = _cubic_row(image, channel_offsets, mask, row, col, wx0, wx1, wx2, wx3, H, W)
        r2 = _cubic_row(image, channel_offsets, mask, row + 1, col, wx0, wx1, wx2, wx3, H, W)
        r3 = _cubic_row(image, channel_offsets, mask, row + 2, col, wx0, wx1, wx2, wx3, H, W)
        sampled = r0 * wy0[None, :] + r1 * wy1[None, :] + r2 * wy2[None, :] + r3 * wy3[None, :]
    else:
        ix = tl.minimum(tl.maximum(ix, 0.0), W - 1.0)
        iy = tl.minimum(tl.maximum(iy, 0.0), H - 1.0)
        col, row = tl.floor(ix), tl.floor(iy)
        right, left = (ix - col)[None, :], (col + 1.0 - ix)[None, :]  # grid_sample's corner weights
        lower, upper = (iy - row)[None, :], (row + 1.0 - iy)[None, :]
        col, row = col.to(tl.int32), row.to(tl.int32)
        sampled = _tap(image, channel_offsets, mask, row, col, H, W) * (left * upper)
        sampled += _tap(image, channel_offsets, mask, row, col + 1, H, W) * (right * upper)
        sampled += _tap(image, channel_offsets, mask, row + 1, col, H, W) * (left * lower)
        sampled += _tap(image, channel_offsets, mask, row + 1, col + 1, H, W) * (right * lower)
    rounded = tl.minimum(tl.maximum(tl.floor(sampled + 0.5), 0.0), 255.0)
    fill = tl.load(fill_ptr + channels, mask=channels < C, other=0.0)
    return tl.where(inside[None, :], rounded, fill[:, None])


@triton.jit
def _smoothed(image, channel_offsets, mask, values, x, y, H, W):
    """ImageFilter.SMOOTH as rand_augment.sharpness's degenerate: (3x3 sum + 4 centre) / 13 rounded inside,
    the pixel itself on the border."""
    box = tl.zeros(values.shape, tl.int32)
    for dy in tl.static_range(3):
        for dx in tl.static_range(3):
            row = tl.minimum(tl.maximum(y + dy - 1, 0), H - 1)
            col = tl.minimum(tl.maximum(x + dx - 1, 0), W - 1)
            box += tl.load(image + channel_offsets + (row * W + col)[None, :], mask=mask, other=0).to(tl.int32)
    smooth = tl.floor(tl.math.div_rn((box + 4 * values).to(tl.float32), 13.0) + 0.5)
    smooth = tl.minimum(tl.maximum(smooth, 0.0), 255.0)
    border = (x == 0) | (x == W - 1) | (y == 0) | (y == H - 1)
    return tl.where(border[None, :], values.to(tl.float32), smooth)


@triton.jit
def pass_kernel(
    images_ptr,  # uint8 (N, C, H, W)
    out_ptr,  # uint8 (N, C, H, W), or fp32 when FINAL
    plan_ptr,  # fp64 (N, PLAN_WIDTH)
    tables_ptr,  # fp64 (N, 256): Kind.LUT's table
    hist_ptr,  # int32 (N, C + 1, 256): histogram_kernel's
    cumulative_ptr,  # int32 (N, C + 1, 256): its running sums
    boxes_ptr,  # fp64 (N, 5): erased box (top, left, height, width) and its first noise index
    noise_ptr,  # fp32: erasing's noise
    fill_ptr,
    mean_ptr,
    std_ptr,  # fp32 (C,)
    H,
    W,
    C: tl.constexpr,
    CP: tl.constexpr,
    BICUBIC: tl.constexpr,
    FINAL: tl.constexpr,
    ERASE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One RandAugment layer for every image; FINAL: then normalization and erasing, written as fp32."""
    n = tl.program_id(0)
    HW = H * W
    pixels = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = pixels < HW
    y, x = pixels // W, pixels % W
    channels = tl.arange(0, CP)
    mask = (channels[:, None] < C) & valid[None, :]
    channel_offsets = channels[:, None] * HW
    image = images_ptr + n * C * HW
    plan = plan_ptr + n * ROW
    kind = tl.load(plan).to(tl.int32)
    if kind == WARP:
        value = _warp(image, plan, fill_ptr, channels, channel_offsets, mask, x, y, H, W, C, BICUBIC)
    else:
        values = tl.load(image + channel_offsets + pixels[None, :], mask=mask, other=0).to(tl.int32)
        stats = (n * (C + 1) + channels[:, None]) * 256
        if kind == NONE:
            value = values.to(tl.float32)
        elif kind == LUT:
            value = tl.load(tables_ptr + n * 256 + values, mask=mask, other=0).to(tl.float32)
        elif (kind == EQUALIZE) | (kind == AUTOCONTRAST):
            bins = tl.arange(0, 256)[None, :]
            counts = tl.load(hist_ptr + stats + bins, mask=channels[:, None] < C, other=0)
            high = tl.max(tl.where(counts > 0, bins, -1), 1)[:, None]
            if kind == EQUALIZE:  # torchvision's equalize (Pillow's): (levels below + step // 2) // step
                last = tl.sum(tl.where(bins == high, counts, 0), 1)[:, None]
                step = (HW - last) // 255
                below = tl.load(cumulative_ptr + stats + values, mask=mask, other=0)
                below -= tl.load(hist_ptr + stats + values, mask=mask, other=0)
                equalized = tl.minimum((below + step // 2) // tl.maximum(step, 1), 255)
                value = tl.where(step > 0, equalized, values).to(tl.float32)
            else:  # ImageOps.autocontrast, in fp64 as rand_augment.auto_contrast
                low = tl.min(tl.where(counts > 0, bins, 256), 1)[:, None]
                scale = 255.0 / tl.maximum(high - low, 1).to(tl.float64)
                stretched = values.to(tl.float64) * scale - low.to(tl.float64) * scale
                stretched = tl.minimum(tl.maximum(stretched.to(tl.int32), 0), 255)
                value = tl.where(high > low, stretched, values).to(tl.float32)
        else:  # Pillow's Image.blend(degenerate, image, factor) in fp32, clipped, truncated
            factor = tl.load(plan + 1).to(tl.float32)
            if kind == BLEND_GRAY:
                degenerate = tl.broadcast_to(_gray(values, channels, C)[None, :], (CP, BLOCK)).to(tl.float32)
            elif kind == BLEND_SMOOTH:
                degenerate = _smoothed(image, channel_offsets, mask, values, x, y, H, W)
            elif kind == BLEND_MEAN:  # int(mean gray + 0.5), the mean in fp64 from the gray histogram
                gray_counts = tl.load(hist_ptr + (n * (C + 1) + C) * 256 + tl.arange(0, 256))
                total = tl.sum(gray_counts.to(tl.float64) * tl.arange(0, 256).to(tl.float64), 0)
                mean = tl.floor(total / HW + 0.5).to(tl.float32)
                degenerate = tl.full((CP, BLOCK), 0.0, tl.float32) + mean
            else:  # Kind.BLEND_ZERO
                degenerate = tl.full((CP, BLOCK), 0.0, tl.float32)
            blended = degenerate + factor * (values.to(tl.float32) - degenerate)
            value = tl.floor(tl.minimum(tl.maximum(blended, 0.0), 255.0))
    out = out_ptr + n * C * HW + channel_offsets + pixels[None, :]
    if FINAL:
        mean = tl.load(mean_ptr + channels, mask=channels < C, other=0.0)[:, None]
        std = tl.load(std_ptr + channels, mask=channels < C, other=1.0)[:, None]
        normalized = tl.math.div_rn(tl.math.div_rn(value, 255.0) - mean, std)
        if ERASE != 0:
            box = boxes_ptr + n * 5
            top, left = tl.load(box).to(tl.int32), tl.load(box + 1).to(tl.int32)
            height, width = tl.load(box + 2).to(tl.int32), tl.load(box + 3).to(tl.int32)
            erased = (y >= top) & (y < top + height) & (x >= left) & (x < left + width)
            erased = erased[None, :] & mask
            if ERASE == ERASE_PIXEL:  # masked_scatter_'s order: image, channel, row, column
                first = tl.load(box + 4).to(tl.int32)
                index = first + channels[:, None] * height * width + ((y - top) * width + x - left)[None, :]
                noise = tl.load(noise_ptr + index, mask=erased, other=0.0)
            elif ERASE == ERASE_RAND:  # one color per image and channel
                noise = tl.load(noise_ptr + n * C + channels[:, None] + 0 * pixels[None, :], mask=erased, other=0.0)
            else:
                noise = tl.full((CP, BLOCK), 0.0, tl.float32)
            normalized = tl.where(erased, noise, normalized)
        tl.store(out, normalized, mask=mask)
    else:
        tl.store(out, value.to(tl.uint8), mask=mask)
