"""ImageNet-C-style common corruptions, generated on the fly for any dataset and image size.

The 15 corruptions and 5 severities of Hendrycks & Dietterich, "Benchmarking Neural Network
Robustness to Common Corruptions and Perturbations" (ICLR 2019), written in torch (plus PIL for
JPEG and pixelate) so that no new dependency is needed. The severity parameters are the published ImageNet-C
ones (`SEVERITY_PARAMS`), stated for 224x224 images; the code is our own.

Every function takes a float batch ``(B, C, H, W)`` of pixels in [0, 1] (C = 1 or 3) and returns a
batch of the same shape, dtype and range. How other image sizes are handled:

- Per-pixel corruptions (noise, brightness, contrast, JPEG) and the ones whose parameters are
  relative (zoom factors, pixelation factor) run at the image's own size with the table's values.
- Filters with sizes in pixels (defocus, motion blur, elastic) have those sizes multiplied by
  ``s = min(H, W) / 224``, so an image looks at any size as the 224 one would when resized (on
  small images the mildest blurs then change little: defocus severity 1 is a radius of 0.4 px
  at 32x32).
- Textures (snow, frost, fog) are generated at the reference scale (short side 224) with the
  table's values and resized to the image.
- Glass blur shuffles whole pixels, which has no fractional version: it runs on the image resized
  to the reference scale and the result is resized back.

At 224x224 the corruptions follow the published recipes, with these differences:

- frost: ImageNet-C blends crops of six frost photographs; we have none, so a procedural texture
  of ice needles modulated by a plasma fractal takes their place (same blend weights, texture
  parameters in `FROST_TEXTURE`). Frost numbers are therefore not comparable with published
  ImageNet-C frost numbers.
- glass blur: the published sequential pixel swaps are kept, but drawn once per batch (the
  shuffle does not depend on the image), so the images of one batch share the shuffle pattern.
- pixelate resizes float images (PIL 'F' mode) rather than 8-bit ones.
- motion blur uses our own line kernel built like ImageMagick's (one-sided Gaussian weights over
  2 * ceil(radius) + 1 taps), defocus an area-weighted disk; borders are mirrored everywhere.
- ImageNet-C stores its images as JPEG (quality 85); corruptions made on the fly skip that step.
- elastic transform: the published table is not monotonic in damage (severities 1-2 are large
  smooth warps, 3-5 small local jitter); we keep it as published.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from convbias.base.errors import ConfigError

from .filters import center_zoom, filter2d, gaussian_blur, line_kernels, motion_kernels, plasma_fractal

REFERENCE_SIZE = 224

CATEGORIES: dict[str, tuple[str, ...]] = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
    "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
    "weather": ("snow", "frost", "fog", "brightness"),
    "digital": ("contrast", "elastic_transform", "pixelate", "jpeg_compression"),
}

SEVERITIES = (1, 2, 3, 4, 5)

# ImageNet-C parameters, one entry per severity 1..5 (pixel sizes are for 224x224 images).
SEVERITY_PARAMS: dict[str, tuple] = {
    # standard deviation of additive Gaussian noise on [0, 1] pixels
    "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    # photon count per unit intensity: Poisson(x * c) / c
    "shot_noise": (60, 25, 12, 5, 3),
    # fraction of values replaced by 0 or 1 (salt and pepper, half each)
    "impulse_noise": (0.03, 0.06, 0.09, 0.17, 0.27),
    # (disk radius px, anti-aliasing Gaussian sigma px)
    "defocus_blur": ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)),
    # (Gaussian sigma px, max pixel displacement px, shuffle iterations)
    "glass_blur": ((0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)),
    # (kernel radius px, Gaussian sigma px); the angle is uniform in [-45, 45] degrees
    "motion_blur": ((10, 3), (15, 5), (15, 8), (15, 12), (20, 15)),
    # zoom factors: numpy.arange(start, stop, step), averaged with the image itself
    "zoom_blur": ((1, 1.11, 0.01), (1, 1.16, 0.01), (1, 1.21, 0.02), (1, 1.26, 0.02), (1, 1.31, 0.03)),
    # (flake mean, flake std, flake zoom, threshold, blur radius px, blur sigma px, image weight)
    "snow": (
        (0.1, 0.3, 3, 0.5, 10, 4, 0.8),
        (0.2, 0.3, 2, 0.5, 12, 4, 0.7),
        (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
        (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65),
        (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55),
    ),
    # (image weight, frost weight)
    "frost": ((1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75)),
    # (fog strength, plasma fractal decay)
    "fog": ((1.5, 2), (2, 2), (2.5, 1.7), (2.5, 1.5), (3, 1.4)),
    # added to the HSV value channel
    "brightness": (0.1, 0.2, 0.3, 0.4, 0.5),
    # factor on the deviation from the per-channel mean
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
    # (displacement scale px, displacement smoothing sigma px, random affine shift px), published
    # as multiples of 244 (a typo for 224 in the original, kept as is)
    "elastic_transform": (
        (244 * 2, 244 * 0.7, 244 * 0.1),
        (244 * 2, 244 * 0.08, 244 * 0.2),
        (244 * 0.05, 244 * 0.01, 244 * 0.02),
        (244 * 0.07, 244 * 0.01, 244 * 0.02),
        (244 * 0.12, 244 * 0.01, 244 * 0.02),
    ),
    # side of the low-resolution image, as a fraction of the side
    "pixelate": (0.6, 0.5, 0.4, 0.3, 0.25),
    # JPEG quality
    "jpeg_compression": (25, 18, 15, 10, 7),
}

# Procedural frost (replaces the six photographs of ImageNet-C; see the module docstring).
FROST_TEXTURE = dict(
    needle_orientations=6,  # needle directions, evenly spread over 180 degrees
    needle_density=0.004,  # needle seeds per pixel and per orientation
    needle_length=(6, 24),  # px at the reference scale, uniform per orientation
    background=0.12,  # base brightness of the ice
    needle_gain=0.6,  # brightness of saturated needles
    haze_gain=0.25,  # low-frequency haze from a plasma fractal
    tint=(0.85, 0.93, 1.0),  # RGB multipliers: bluish white
)


def _param(name: str, severity: int):
    if severity not in SEVERITIES:
        raise ConfigError(f"severity must be one of {SEVERITIES}, got {severity!r}")
    return SEVERITY_PARAMS[name][severity - 1]


def _uniform(shape, low, high, generator, device) -> torch.Tensor:
    return torch.rand(shape, generator=generator).to(device) * (high - low) + low


def _scale(x: torch.Tensor) -> float:
    """Ratio of the image's short side to the 224 px the parameters are stated for."""
    return min(x.shape[-2:]) / REFERENCE_SIZE


def _reference_shape(x: torch.Tensor) -> tuple[int, int]:
    s = _scale(x)
    return round(x.shape[-2] / s), round(x.shape[-1] / s)


def _resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)


def _gray(x: torch.Tensor) -> torch.Tensor:
    """Luma (ITU-R 601, as OpenCV's RGB2GRAY) of a (B, C, H, W) batch, as (B, 1, H, W)."""
    if x.shape[1] == 1:
        return x
    weights = x.new_tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
    return (x * weights).sum(1, keepdim=True)


def _fractal_layer(x: torch.Tensor, decay: float, generator: torch.Generator) -> torch.Tensor:
    """A plasma fractal cropped at the reference scale and resized to x: (B, 1, H, W)."""
    ref_h, ref_w = _reference_shape(x)
    size = max(256, 1 << (max(ref_h, ref_w) - 1).bit_length())
    fractal = plasma_fractal(x.shape[0], size, decay, generator)[:, None, :ref_h, :ref_w]
    return _resize(fractal.to(x), x.shape[-2:])


# ---------------------------------------------------------------------------------------------
# Noise
# ---------------------------------------------------------------------------------------------


def gaussian_noise(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    std = _param("gaussian_noise", severity)
    noise = torch.randn(x.shape, generator=generator).to(x)
    return (x + std * noise).clamp(0, 1)


def shot_noise(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    photons = _param("shot_noise", severity)
    counts = torch.poisson((x * photons).float().cpu(), generator=generator).to(x)
    return (counts / photons).clamp(0, 1)


def impulse_noise(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    amount = _param("impulse_noise", severity)
    flipped = _uniform(x.shape, 0, 1, generator, x.device) < amount
    salt = (_uniform(x.shape, 0, 1, generator, x.device) < 0.5).to(x)
    return torch.where(flipped, salt, x)


# ---------------------------------------------------------------------------------------------
# Blur
# ---------------------------------------------------------------------------------------------


def _disk_kernel(radius: float, supersample: int = 8) -> torch.Tensor:
    """Normalized disk of the given radius, each pixel weighted by the fraction of its area
    inside the disk (so that radii below a pixel still give distinct kernels)."""
    reach = math.ceil(radius + 0.5)
    sub = (torch.arange(supersample, dtype=torch.float64) + 0.5) / supersample - 0.5
    centers = torch.arange(-reach, reach + 1, dtype=torch.float64)
    coords = (centers.view(-1, 1) + sub.view(1, -1)).flatten()  # sub-pixel coordinates
    inside = (coords.view(-1, 1) ** 2 + coords.view(1, -1) ** 2) <= radius**2
    size = 2 * reach + 1
    coverage = inside.view(size, supersample, size, supersample).double().mean((1, 3))
    coverage[reach, reach] = max(coverage[reach, reach].item(), 1e-6)  # radius 0: identity
    return (coverage / coverage.sum()).float()


def defocus_blur(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    radius, alias_sigma = _param("defocus_blur", severity)
    s = _scale(x)
    blurred = filter2d(x, _disk_kernel(radius * s))
    return gaussian_blur(blurred, alias_sigma * s).clamp(0, 1)


def _glass_permutation(h: int, w: int, max_delta: int, iterations: int, generator: torch.Generator) -> torch.Tensor:
    """ImageNet-C's local shuffle as a permutation of the h * w pixel indices: scanning from the
    bottom-right corner, each interior pixel is swapped with the pixel at a random offset in
    [-max_delta, max_delta - 1]^2 (a pixel can move several times). It does not depend on the
    image, so one permutation serves a whole batch."""
    rows = torch.arange(h - max_delta, max_delta, -1).view(-1, 1)
    cols = torch.arange(w - max_delta, max_delta, -1).view(1, -1)
    here = (rows * w + cols).flatten()  # scan order of the swaps
    order = list(range(h * w))
    for _ in range(iterations):
        offsets = torch.randint(-max_delta, max_delta, (here.numel(), 2), generator=generator)
        there = here + offsets[:, 0] * w + offsets[:, 1]
        for a, b in zip(here.tolist(), there.tolist()):
            order[a], order[b] = order[b], order[a]
    return torch.tensor(order)


def glass_blur(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    """Blur, shuffle pixels locally, blur again; at the reference scale (see module docstring).
    The pixels of all the images of a batch move the same way."""
    sigma, max_delta, iterations = _param("glass_blur", severity)
    size = x.shape[-2:]
    image = gaussian_blur(_resize(x, _reference_shape(x)), sigma)
    h, w = image.shape[-2:]
    order = _glass_permutation(h, w, max_delta, iterations, generator).to(x.device)
    image = image.flatten(2)[:, :, order].view_as(image)
    image = gaussian_blur(image, sigma)
    return _resize(image, size).clamp(0, 1)


def motion_blur(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    radius, sigma = _param("motion_blur", severity)
    angles = _uniform((x.shape[0],), -45, 45, generator, "cpu")
    kernels = motion_kernels(radius, sigma, angles, _scale(x))
    return filter2d(x, kernels).clamp(0, 1)


def zoom_blur(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    start, stop, step = _param("zoom_blur", severity)
    factors = np.arange(start, stop, step)
    total = x.clone()
    for factor in factors:
        total += center_zoom(x, float(factor))
    return (total / (len(factors) + 1)).clamp(0, 1)


# ---------------------------------------------------------------------------------------------
# Weather
# ---------------------------------------------------------------------------------------------


def snow(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    mean, std, zoom, threshold, radius, sigma, image_weight = _param("snow", severity)
    b = x.shape[0]
    ref_h, ref_w = _reference_shape(x)
    flakes = torch.randn((b, 1, ref_h, ref_w), generator=generator) * std + mean
    flakes = center_zoom(flakes, zoom)
    flakes = torch.where(flakes < threshold, torch.zeros_like(flakes), flakes).clamp(0, 1)
    angles = _uniform((b,), -135, -45, generator, "cpu")
    flakes = filter2d(flakes, motion_kernels(radius, sigma, angles, 1.0))
    flakes = _resize(flakes.to(x), x.shape[-2:])
    whitened = torch.maximum(x, _gray(x) * 1.5 + 0.5)
    x = image_weight * x + (1 - image_weight) * whitened
    return (x + flakes + flakes.flip(-2, -1)).clamp(0, 1)


def frost_texture(batch: int, height: int, width: int, channels: int, generator: torch.Generator) -> torch.Tensor:
    """Procedural frost at the reference scale: (batch, channels, height, width) in [0, 1].

    Ice needles (random seeds smeared along a few directions) whose density is modulated by a
    plasma fractal, over a faint fractal haze, tinted bluish white. Parameters: FROST_TEXTURE.
    """
    p = FROST_TEXTURE
    needles = torch.zeros(batch, 1, height, width)
    for k in range(p["needle_orientations"]):
        seeds = (torch.rand((batch, 1, height, width), generator=generator) < p["needle_density"]).float()
        low, high = p["needle_length"]
        length = int(torch.randint(low, high + 1, (1,), generator=generator))
        base_angle = 180.0 * k / p["needle_orientations"]
        angles = base_angle + _uniform((batch,), -15, 15, generator, "cpu")
        kernels = line_kernels(torch.ones(length), 1.0, angles) * length  # unnormalized streaks
        needles += filter2d(seeds, kernels)
    size = max(256, 1 << (max(height, width) - 1).bit_length())
    patches = plasma_fractal(batch, size, 2.0, generator)[:, None, :height, :width]
    haze = plasma_fractal(batch, size, 1.5, generator)[:, None, :height, :width]
    ice = 1 - torch.exp(-needles)  # saturating needles
    ice = gaussian_blur(ice, 0.7) * (0.3 + 0.7 * patches)
    gray = p["background"] + p["needle_gain"] * ice + p["haze_gain"] * haze
    if channels == 1:
        tint = torch.tensor(p["tint"]).mean().view(1, 1, 1, 1)
    else:
        tint = torch.tensor(p["tint"]).view(1, 3, 1, 1)
    return (gray * tint).clamp(0, 1)


def frost(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    image_weight, frost_weight = _param("frost", severity)
    ref_h, ref_w = _reference_shape(x)
    texture = frost_texture(x.shape[0], ref_h, ref_w, x.shape[1], generator)
    texture = _resize(texture.to(x), x.shape[-2:])
    return (image_weight * x + frost_weight * texture).clamp(0, 1)


def fog(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    strength, decay = _param("fog", severity)
    peak = x.amax((1, 2, 3), keepdim=True)
    fogged = x + strength * _fractal_layer(x, decay, generator)
    return (fogged * peak / (peak + strength)).clamp(0, 1)


def brightness(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    """Add c to the HSV value. Hue and saturation are unchanged, so RGB scales by (v + c) / v
    (a black pixel, whose saturation is 0, becomes gray c)."""
    shift = _param("brightness", severity)
    value = x.amax(1, keepdim=True)
    new_value = (value + shift).clamp(max=1)
    scaled = x * new_value / value.clamp(min=1e-12)
    return torch.where(value > 0, scaled, new_value.expand_as(x)).clamp(0, 1)


# ---------------------------------------------------------------------------------------------
# Digital
# ---------------------------------------------------------------------------------------------


def contrast(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    factor = _param("contrast", severity)
    means = x.mean((2, 3), keepdim=True)
    return ((x - means) * factor + means).clamp(0, 1)


def elastic_transform(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    """Random affine warp (three control points moved by up to `shift` px) followed by a smooth
    random displacement field (uniform noise, Gaussian-smoothed, times `alpha`); bilinear
    sampling with mirrored borders."""
    alpha, sigma, shift = (value * _scale(x) for value in _param("elastic_transform", severity))
    b, _, h, w = x.shape
    center = torch.tensor([w // 2, h // 2], dtype=torch.float64)
    half = min(h, w) // 3
    source = torch.stack([center + half, center + torch.tensor([half, -half]), center - half])
    moved = source + _uniform((b, 3, 2), -shift, shift, generator, "cpu").double()
    # forward affine: [source, 1] @ forward^T = moved; sampling needs its inverse
    homogeneous = torch.cat([source, torch.ones(3, 1, dtype=torch.float64)], 1)
    forward = torch.linalg.solve(homogeneous, moved).transpose(1, 2)  # (b, 2, 3)
    inverse_linear = torch.linalg.inv(forward[:, :, :2])
    field = _uniform((b, 2, h, w), -1, 1, generator, "cpu")
    field = gaussian_blur(field, sigma, truncate=3.0) * alpha  # (dx, dy)
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    points = torch.stack([xs, ys], -1).expand(b, h, w, 2) + field.permute(0, 2, 3, 1).double()
    sampled = torch.einsum("bij,bhwj->bhwi", inverse_linear, points - forward[:, None, None, :, 2])
    grid = 2 * sampled / torch.tensor([max(w - 1, 1), max(h - 1, 1)], dtype=torch.float64) - 1
    warped = F.grid_sample(x, grid.to(x), mode="bilinear", padding_mode="reflection", align_corners=True)
    return warped.clamp(0, 1)


def _pil_channels(x: torch.Tensor, apply: Callable[[Image.Image], Image.Image]) -> torch.Tensor:
    """Apply a PIL operation to every channel of every image, as 32-bit float ('F') images."""
    planes = [
        torch.from_numpy(np.asarray(apply(Image.fromarray(plane, "F")), dtype=np.float32).copy())
        for plane in x.detach().float().cpu().flatten(0, 1).numpy()
    ]
    return torch.stack(planes).view(*x.shape[:2], *planes[0].shape).to(x)


def pixelate(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    """PIL BOX resize to a fraction of the size and back, as ImageNet-C."""
    fraction = _param("pixelate", severity)
    h, w = x.shape[-2:]
    small = (max(int(w * fraction), 1), max(int(h * fraction), 1))
    return _pil_channels(x, lambda image: image.resize(small, Image.BOX).resize((w, h), Image.BOX)).clamp(0, 1)


def jpeg_compression(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    quality = _param("jpeg_compression", severity)
    pixels = (x.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    mode = "L" if x.shape[1] == 1 else "RGB"
    out = []
    for image in pixels.permute(0, 2, 3, 1).numpy():
        buffer = io.BytesIO()
        Image.fromarray(image.squeeze(-1) if mode == "L" else image, mode).save(buffer, "JPEG", quality=quality)
        decoded = np.asarray(Image.open(buffer).convert(mode), dtype=np.uint8)
        out.append(torch.from_numpy(decoded.reshape(image.shape).copy()))
    return (torch.stack(out).permute(0, 3, 1, 2).to(x) / 255).clamp(0, 1)


CORRUPTIONS: dict[str, Callable[[torch.Tensor, int, torch.Generator], torch.Tensor]] = {
    fn.__name__: fn
    for fn in (
        gaussian_noise,
        shot_noise,
        impulse_noise,
        defocus_blur,
        glass_blur,
        motion_blur,
        zoom_blur,
        snow,
        frost,
        fog,
        brightness,
        contrast,
        elastic_transform,
        pixelate,
        jpeg_compression,
    )
}

CATEGORY_OF: dict[str, str] = {name: category for category, names in CATEGORIES.items() for name in names}


def corrupt(images: torch.Tensor, name: str, severity: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Apply corruption `name` at `severity` (1-5) to a float batch (B, C, H, W) in [0, 1].

    Returns a new batch of the same shape, dtype and device with values in [0, 1]. Randomness
    comes from `generator` (a CPU torch.Generator; a fresh unseeded one if None).
    """
    if name not in CORRUPTIONS:
        raise ConfigError(f"unknown corruption {name!r}; expected one of {', '.join(CORRUPTIONS)}")
    if severity not in SEVERITIES:
        raise ConfigError(f"severity must be one of {SEVERITIES}, got {severity!r}")
    if images.dim() != 4 or images.shape[1] not in (1, 3) or not images.is_floating_point():
        raise ValueError(f"expected a float batch (B, 1 or 3, H, W), got {tuple(images.shape)} {images.dtype}")
    if generator is None:
        generator = torch.Generator()
        generator.seed()
    with torch.no_grad():
        return CORRUPTIONS[name](images, severity, generator).to(images.dtype)
