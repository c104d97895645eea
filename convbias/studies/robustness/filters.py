"""Image filters for the generated corruptions: correlation with mirrored borders (direct or through the
FFT), separable Gaussian blur, motion-blur line kernels, center zoom and plasma-fractal height maps."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FFT_KERNEL_SIZE = 121  # kernels with more taps are applied through the FFT


def _mirror_index(n: int, pad: int, device) -> torch.Tensor:
    """Indices of a length-n axis padded by `pad` on both sides by half-sample mirroring
    (d c b a | a b c d | d c b a), valid for pads wider than the axis."""
    positions = torch.arange(-pad, n + pad, device=device) % (2 * n)
    return torch.where(positions < n, positions, 2 * n - 1 - positions)


def mirror_pad(x: torch.Tensor, pad_h: int, pad_w: int) -> torch.Tensor:
    rows = _mirror_index(x.shape[-2], pad_h, x.device)
    cols = _mirror_index(x.shape[-1], pad_w, x.device)
    return x.index_select(-2, rows).index_select(-1, cols)


def filter2d(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Correlate every channel of x (B, C, H, W) with a kernel (kh, kw) or one kernel per image
    (B, kh, kw), odd sizes, mirrored borders. Large kernels go through the FFT."""
    b, c, h, w = x.shape
    if kernel.dim() == 2:
        kernel = kernel.unsqueeze(0)
    kh, kw = kernel.shape[-2:]
    padded = mirror_pad(x, kh // 2, kw // 2)
    kernel = kernel.to(x)
    if kh * kw <= FFT_KERNEL_SIZE:
        weight = kernel.expand(b, kh, kw).repeat_interleave(c, dim=0).unsqueeze(1)
        out = F.conv2d(padded.reshape(1, b * c, *padded.shape[-2:]), weight, groups=b * c)
        return out.view(b, c, h, w)
    # correlation theorem: no wrap-around for the h x w outputs kept, as the input is padded
    size, precision = padded.shape[-2:], torch.promote_types(x.dtype, torch.float32)
    spectrum = torch.fft.rfft2(padded.to(precision), s=size) * torch.fft.rfft2(
        kernel.to(precision), s=size
    ).conj().unsqueeze(1)
    return torch.fft.irfft2(spectrum, s=size)[..., :h, :w].to(x.dtype)


def gaussian_kernel1d(sigma: float, truncate: float = 4.0) -> torch.Tensor:
    radius = max(int(truncate * sigma + 0.5), 0)
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-0.5 * (offsets / max(sigma, 1e-8)) ** 2)
    return (kernel / kernel.sum()).float()


def gaussian_blur(x: torch.Tensor, sigma: float, truncate: float = 4.0) -> torch.Tensor:
    """Separable Gaussian blur with mirrored borders (kernel radius truncate * sigma)."""
    kernel = gaussian_kernel1d(sigma, truncate)
    if kernel.numel() == 1:
        return x
    x = filter2d(x, kernel.view(1, -1))
    return filter2d(x, kernel.view(-1, 1))


def line_kernels(weights: torch.Tensor, spacing: float, angles_deg: torch.Tensor) -> torch.Tensor:
    """One kernel per angle: tap i (weight weights[i]) sits at distance i * spacing from the
    center along the angle, splatted bilinearly; kernels are normalized to sum 1."""
    reach = math.ceil(spacing * (len(weights) - 1)) + 1
    size = 2 * reach + 1
    angles = torch.deg2rad(angles_deg.double()).view(-1, 1)
    steps = torch.arange(len(weights), dtype=torch.float64) * spacing
    xs = reach + steps * torch.cos(angles)  # (A, taps)
    ys = reach + steps * torch.sin(angles)
    x0, y0 = xs.floor(), ys.floor()
    kernels = torch.zeros(len(angles), size * size, dtype=torch.float64)
    for dx in (0, 1):
        for dy in (0, 1):
            share = (1 - (xs - x0 - dx).abs()) * (1 - (ys - y0 - dy).abs())
            index = ((y0 + dy).clamp(0, size - 1) * size + (x0 + dx).clamp(0, size - 1)).long()
            kernels.scatter_add_(1, index, share * weights.double())
    kernels = kernels.view(-1, size, size)
    return (kernels / kernels.sum((1, 2), keepdim=True)).float()


def motion_kernels(radius: float, sigma: float, angles_deg: torch.Tensor, scale: float) -> torch.Tensor:
    """ImageMagick-style motion blur: 2 * ceil(radius) + 1 taps on one side of the pixel with
    weights exp(-i^2 / (2 sigma^2)), taps spaced `scale` px apart."""
    taps = torch.arange(2 * math.ceil(radius) + 1, dtype=torch.float64)
    return line_kernels(torch.exp(-(taps**2) / (2 * sigma**2)), scale, angles_deg)


def center_zoom(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Zoom into the center by `factor`, keeping the size (bilinear)."""
    theta = x.new_tensor([[1 / factor, 0, 0], [0, 1 / factor, 0]]).expand(x.shape[0], 2, 3)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def plasma_fractal(batch: int, size: int, decay: float, generator: torch.Generator) -> torch.Tensor:
    """Diamond-square height maps (batch, size, size) in [0, 1], size a power of two, as in
    ImageNet-C's fog: the random perturbation at each level is wibble * U(-wibble, wibble) with
    wibble starting at 100 and divided by `decay` at each level."""
    if size & (size - 1):
        raise ValueError(f"plasma_fractal size must be a power of two, got {size}")
    height = torch.zeros(batch, size, size, dtype=torch.float64)
    step, wibble = size, 100.0

    def perturbed_mean(total: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(total.shape, generator=generator, dtype=torch.float64) * 2 - 1
        return total / 4 + wibble * wibble * noise

    while step >= 2:
        half = step // 2
        corners = height[:, 0::step, 0::step]
        square_sum = corners + corners.roll(-1, 1)
        square_sum = square_sum + square_sum.roll(-1, 2)
        height[:, half::step, half::step] = perturbed_mean(square_sum)
        centers = height[:, half::step, half::step]
        corners = height[:, 0::step, 0::step]
        # diamonds on the rows of the corners, then on the columns of the corners
        row_sum = centers + centers.roll(1, 1) + corners + corners.roll(-1, 2)
        height[:, 0::step, half::step] = perturbed_mean(row_sum)
        col_sum = centers + centers.roll(1, 2) + corners + corners.roll(-1, 1)
        height[:, half::step, 0::step] = perturbed_mean(col_sum)
        step //= 2
        wibble /= decay
    low = height.amin((1, 2), keepdim=True)
    high = height.amax((1, 2), keepdim=True)
    return ((height - low) / (high - low)).float()
