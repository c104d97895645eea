"""Maximum-entropy diffeomorphisms of images (Petrini et al. 2021, sec. 2 and app. A-C).

A displacement field tau = (tau_u, tau_v) on the unit square, with tau_u, tau_v independent and

    tau_u(u, v) = sum_{(i, j) in M_c} C_ij sin(i pi u) sin(j pi v),  C_ij ~ N(0, T / (i^2 + j^2)),

so tau vanishes on the frame. The modes M_c kept under the cut-off c (`MODE_SETS`): "published" (default),
i, j >= 1 with sqrt(i^2 + j^2) < c + 1/2, as the authors' library (pcsl-epfl/diffeomorphism,
`scalar_field_modes`) draws them; "disc", i^2 + j^2 <= c^2, the paper's wording (sec. 2.1), which drops the
modes on the rim (6 vs 4 modes per component at c = 3, 19 vs 15 at c = 5).

The deformed image is [tau x](s) = x(s - tau(s)), resampled bilinearly (`grid_sample`, the paper's default)
or with the Gaussian interpolation of app. C.

Rectangular images: the unit square is stretched onto the H x W image, pixel k of an axis of n pixels
sitting at k / (n - 1) (so the frame pixels never move), and a displacement along an axis is measured in
that axis' pixels as tau * n (as in the reference library, pcsl-epfl/diffeomorphism). The typical
displacement then reads delta^2 = (pi / 8) (H^2 + W^2) T ln c: the paper's delta^2 = (pi / 4) n^2 T ln c
with n^2 replaced by (H^2 + W^2) / 2. Far from a square, the field's cross-derivatives scale by the aspect
ratio, which the temperature range below (derived for squares) does not account for.

The user asks for (delta, c); `temperature(delta, c, size)` turns it into T, inside the range of
acceptable diffeomorphisms `temperature_range(c, size)`: from T_min (delta = 1/2 pixel, below which the
result depends on the interpolation) to T_max = 4 / (pi^3 c^2 ln c) (beyond which the map folds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from convbias.base.errors import ConfigError

__all__ = [
    "INTERPOLATIONS",
    "MODE_SETS",
    "Diffeo",
    "center_displacement",
    "check_cut",
    "check_modes",
    "deform",
    "displacement_field",
    "displacement_range",
    "mean_squared_displacement",
    "mode_mask",
    "sample_fields",
    "temperature",
    "temperature_range",
    "typical_displacement",
]

INTERPOLATIONS = ("bilinear", "gaussian")
MODE_SETS = ("published", "disc")  # sqrt(i^2 + j^2) < c + 1/2 (the authors' library), i^2 + j^2 <= c^2
GAUSSIAN_SIGMA = 0.4715  # app. C: the width (in pixels) of the Gaussian interpolation kernel
_GAUSSIAN_WINDOW = (-1, 0, 1, 2)  # offsets from floor(source): the next pixel out is >= 2 px away (weight < 1.2e-4)

Size = int | Sequence[int]


def _hw(size: Size) -> tuple[int, int]:
    """(H, W) from an int (square) or a pair such as `images.shape[-2:]`."""
    if isinstance(size, int):
        return size, size
    height, width = (int(s) for s in size)
    return height, width


def _side2(size: Size) -> float:
    """n^2 of the square formulas: (H^2 + W^2) / 2."""
    height, width = _hw(size)
    return (height**2 + width**2) / 2


def check_cut(cut: int, size: Size) -> None:
    """The cut-off must be an integer in [2, min(H, W)] (ln c > 0; no mode finer than the pixels)."""
    height, width = _hw(size)
    if isinstance(cut, bool) or not isinstance(cut, int) or not 2 <= cut <= min(height, width):
        raise ConfigError(
            f"cut={cut!r} must be an integer in [2, {min(height, width)}] for a {height}x{width} image "
            f"(c >= 2 so that ln c > 0; c <= the smaller side)"
        )


def typical_displacement(T: float, cut: int, size: Size) -> float:
    """delta, in pixels: delta^2 = (pi / 4) n^2 T ln c, the paper's (and the authors' library's) definition.
    It is the large-c asymptote of the root-mean-square displacement at the centre; the exact value
    (`center_displacement`) is larger for small c: by 27% at c = 3, 15% at c = 5 and 4% at c = 100 with the
    published mode set (8%, 9%, 4% with the disc)."""
    return math.sqrt(math.pi / 4 * _side2(size) * T * math.log(cut))


def temperature(delta: float, cut: int, size: Size) -> float:
    """The T whose typical displacement is `delta` pixels; raises if (delta, c) leaves the diffeomorphism
    region of this image size."""
    low, high = displacement_range(cut, size)
    if not (isinstance(delta, (int, float)) and low <= delta <= high):
        raise ConfigError(
            f"delta={delta!r} is outside the diffeomorphism region [{low:.3g}, {high:.3g}] pixels for "
            f"cut={cut} on a {'x'.join(map(str, _hw(size)))} image (delta >= 1/2, T <= 4 / (pi^3 c^2 ln c))"
        )
    return delta**2 / (math.pi / 4 * _side2(size) * math.log(cut))


def temperature_range(cut: int, size: Size) -> tuple[float, float]:
    """(T_min, T_max): delta = 1/2 pixel, and the fold limit 4 / (pi^3 c^2 ln c); raises when empty."""
    check_cut(cut, size)
    log = math.log(cut)
    t_min = 1 / (math.pi * _side2(size) * log)
    t_max = 4 / (math.pi**3 * cut**2 * log)
    if t_min > t_max:
        height, width = _hw(size)
        raise ConfigError(
            f"cut={cut} is too large for a {height}x{width} image: no temperature gives a displacement "
            f">= 1/2 pixel without folding (needs c <= {2 * math.sqrt(_side2(size)) / math.pi:.1f})"
        )
    return t_min, t_max


def displacement_range(cut: int, size: Size) -> tuple[float, float]:
    """(1/2, delta_max = n / (pi c)): the typical displacements reachable by diffeomorphisms."""
    t_min, t_max = temperature_range(cut, size)
    return typical_displacement(t_min, cut, size), typical_displacement(t_max, cut, size)


def _check_temperature(T: float, cut: int, size: Size) -> None:
    t_min, t_max = temperature_range(cut, size)
    if not (isinstance(T, (int, float)) and t_min <= T <= t_max):
        raise ConfigError(
            f"T={T!r} is outside the diffeomorphism region [{t_min:.3g}, {t_max:.3g}] for cut={cut} on a "
            f"{'x'.join(map(str, _hw(size)))} image"
        )


def check_modes(modes: str) -> None:
    if modes not in MODE_SETS:
        raise ConfigError(f"modes={modes!r} must be one of {MODE_SETS}")


def mode_mask(cut: int, modes: str = "published") -> torch.Tensor:
    """(c, c) booleans: which (i, j), 1 <= i, j <= c, the cut-off keeps."""
    check_modes(modes)
    k = torch.arange(1, cut + 1, dtype=torch.float64)
    r2 = k[:, None] ** 2 + k[None, :] ** 2
    return r2.sqrt() < cut + 0.5 if modes == "published" else r2 <= cut**2


def sample_fields(
    count: int, cut: int, generator: torch.Generator | None = None, modes: str = "published"
) -> torch.Tensor:
    """(count, 2, c, c) coefficients C_ij / sqrt(T) of tau_u and tau_v: N(0, 1 / (i^2 + j^2)) on the mode set
    `modes`, zero elsewhere. Drawn on the CPU so that a seed gives the same fields on any device."""
    k = torch.arange(1, cut + 1, dtype=torch.float64)
    r2 = k[:, None] ** 2 + k[None, :] ** 2
    scale = torch.where(mode_mask(cut, modes), r2.rsqrt(), torch.zeros_like(r2)).float()
    return torch.randn(count, 2, cut, cut, generator=generator) * scale


def mean_squared_displacement(T: float, cut: int, size: Size, modes: str = "published") -> float:
    """E |tau(s)|^2 in pixels^2, averaged over the H x W pixel grid, in closed form: each coefficient has
    variance T / (i^2 + j^2), and sin^2(i pi k / (n - 1)) averages to (n - 1) / (2 n) over the n pixels of an
    axis (every mode but i = n - 1), so E|tau|^2 = (W^2 + H^2) T (H - 1)(W - 1) / (4 H W) sum_{M_c} 1 / (i^2 + j^2)."""
    height, width = _hw(size)
    k = torch.arange(1, cut + 1, dtype=torch.float64)
    r2 = k[:, None] ** 2 + k[None, :] ** 2
    total = float((mode_mask(cut, modes) / r2).sum())
    return (width**2 + height**2) * T * (height - 1) * (width - 1) / (4 * height * width) * total


def center_displacement(T: float, cut: int, size: Size, modes: str = "published") -> float:
    """The exact root-mean-square displacement (pixels) at the centre of the continuous square: only odd
    modes are nonzero there, E|tau|^2 = (W^2 + H^2) T sum_{M_c, i, j odd} 1 / (i^2 + j^2)."""
    height, width = _hw(size)
    k = torch.arange(1, cut + 1, dtype=torch.float64)
    r2 = k[:, None] ** 2 + k[None, :] ** 2
    odd = (k % 2 == 1)[:, None] & (k % 2 == 1)[None, :]
    return math.sqrt((width**2 + height**2) * T * float(((mode_mask(cut, modes) & odd) / r2).sum()))


def _field(coefficients: torch.Tensor, T: float, size: Size) -> torch.Tensor:
    """Pixel displacements as one contiguous (count, H, W, 2) tensor, (x, y) last: `grid_sample`'s layout,
    so that the source positions are computed in place in it."""
    height, width = _hw(size)
    cut = coefficients.shape[-1]
    k = torch.arange(1, cut + 1, dtype=coefficients.dtype, device=coefficients.device)
    sin_u = torch.sin(math.pi * torch.linspace(0, 1, width, device=k.device, dtype=k.dtype)[:, None] * k)  # (W, c)
    sin_v = torch.sin(math.pi * torch.linspace(0, 1, height, device=k.device, dtype=k.dtype)[:, None] * k)  # (H, c)
    tau = torch.einsum("bdij,xi,yj->byxd", coefficients, sin_u, sin_v).contiguous()  # i: mode along u (width)
    return tau.mul_(math.sqrt(T) * torch.tensor([width, height], dtype=tau.dtype, device=tau.device))


def displacement_field(coefficients: torch.Tensor, T: float, size: Size) -> torch.Tensor:
    """Pixel displacements (count, 2, H, W) (channel 0 along the width, 1 along the height) of fields
    `coefficients` from `sample_fields` at temperature T."""
    return _field(coefficients, T, size).permute(0, 3, 1, 2)


def _source_positions(coefficients: torch.Tensor, T: float, size: Size) -> torch.Tensor:
    """(count, H, W, 2) source pixel coordinates (x, y) = s - tau(s), clamped to the image (in place)."""
    height, width = _hw(size)
    source = _field(coefficients, T, size).neg_()
    source[..., 0].add_(torch.arange(width, dtype=source.dtype, device=source.device)).clamp_(0, width - 1)
    source[..., 1].add_(torch.arange(height, dtype=source.dtype, device=source.device)[:, None]).clamp_(0, height - 1)
    return source


def _gaussian_resample(images: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """App. C: each output pixel is the Gaussian-weighted (sigma 0.4715 px) mean of the pixels around its
    source point, over the 4x4 pixels that carry non-negligible weight."""
    count, channels, height, width = images.shape
    base = source.floor()
    flat = images.reshape(count, channels, height * width)
    total = torch.zeros_like(flat)
    norm = torch.zeros(count, 1, height * width, dtype=images.dtype, device=images.device)
    for dy in _GAUSSIAN_WINDOW:
        for dx in _GAUSSIAN_WINDOW:
            px, py = base[..., 0] + dx, base[..., 1] + dy
            inside = (px >= 0) & (px <= width - 1) & (py >= 0) & (py <= height - 1)
            weight = torch.exp(-((source[..., 0] - px) ** 2 + (source[..., 1] - py) ** 2) / (2 * GAUSSIAN_SIGMA**2))
            weight = (weight * inside).reshape(count, 1, -1).to(images.dtype)
            index = (py.clamp(0, height - 1) * width + px.clamp(0, width - 1)).long().reshape(count, 1, -1)
            total += weight * flat.gather(2, index.expand(-1, channels, -1))
            norm += weight
    return (total / norm).reshape(images.shape)


def deform(
    images: torch.Tensor,
    T: float,
    cut: int,
    coefficients: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    interpolation: str = "bilinear",
    modes: str = "published",
) -> torch.Tensor:
    """tau x for a batch (B, C, H, W) (or one (C, H, W) image): one field per image, drawn from `generator`
    on the mode set `modes` unless `coefficients` (from `sample_fields`) are given."""
    if interpolation not in INTERPOLATIONS:
        raise ConfigError(f"interpolation={interpolation!r} must be one of {INTERPOLATIONS}")
    check_modes(modes)
    if not isinstance(images, torch.Tensor) or images.dim() not in (3, 4) or images.shape[0] == 0:
        raise ConfigError(
            f"images must be a non-empty (B, C, H, W) or (C, H, W) tensor, got "
            f"{tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__}"
        )
    single = images.dim() == 3
    batch = images[None] if single else images
    size = batch.shape[-2:]
    _check_temperature(T, cut, size)
    if coefficients is None:
        coefficients = sample_fields(batch.shape[0], cut, generator, modes)
    elif coefficients.shape != (batch.shape[0], 2, cut, cut):
        raise ValueError(
            f"coefficients must have shape {(batch.shape[0], 2, cut, cut)}, got {tuple(coefficients.shape)}"
        )
    source = _source_positions(coefficients.to(batch.device), T, size)
    if interpolation == "gaussian":
        out = _gaussian_resample(batch, source)
    else:  # pixel k -> -1 + 2k / (n - 1): align_corners=True; clamped sources = border padding
        height, width = size
        source[..., 0].mul_(2 / (width - 1)).sub_(1)
        source[..., 1].mul_(2 / (height - 1)).sub_(1)
        out = F.grid_sample(batch, source.to(batch.dtype), mode="bilinear", padding_mode="border", align_corners=True)
    return out[0] if single else out


class Diffeo(torch.nn.Module):
    """Training augmentation (a torchvision/timm tensor transform): with probability `p`, deform the image by
    a max-entropy diffeomorphism of cut-off c drawn uniformly in [cut_min, cut_max] and typical displacement
    delta drawn uniformly in [delta_min, delta_max] (clipped to what that c allows on the image), on the mode
    set `modes`."""

    def __init__(
        self,
        delta: tuple[float, float] = (0.5, 1.0),
        cut: tuple[int, int] = (2, 5),
        p: float = 1.0,
        interpolation: str = "bilinear",
        modes: str = "published",
    ):
        super().__init__()
        delta_min, delta_max = delta
        cut_min, cut_max = cut
        if not 0.5 <= delta_min <= delta_max:
            raise ConfigError(f"delta={delta!r} must be (low, high) with 1/2 <= low <= high pixels")
        if not (isinstance(cut_min, int) and isinstance(cut_max, int) and 2 <= cut_min <= cut_max):
            raise ConfigError(f"cut={cut!r} must be (low, high) integers with 2 <= low <= high")
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"p={p!r} must be a probability in [0, 1]")
        if interpolation not in INTERPOLATIONS:
            raise ConfigError(f"interpolation={interpolation!r} must be one of {INTERPOLATIONS}")
        check_modes(modes)
        self.delta, self.cut, self.p, self.interpolation = (delta_min, delta_max), (cut_min, cut_max), p, interpolation
        self.modes = modes

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        if self.p < 1.0 and torch.rand(()) >= self.p:
            return img
        size = img.shape[-2:]
        cut = int(torch.randint(self.cut[0], min(self.cut[1], min(size)) + 1, ()))
        low, high = displacement_range(cut, size)
        low, high = max(low, self.delta[0]), min(high, self.delta[1])
        if low > high:  # this c cannot reach the requested displacements on this image: leave it as is
            return img
        delta = low + (high - low) * float(torch.rand(()))
        return deform(img, temperature(delta, cut, size), cut, interpolation=self.interpolation, modes=self.modes)

    def extra_repr(self) -> str:
        return (
            f"delta={self.delta}, cut={self.cut}, p={self.p}, interpolation={self.interpolation!r}, "
            f"modes={self.modes!r}"
        )
