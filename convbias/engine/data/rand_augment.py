"""timm's RandAugment ops and random erasing as batched tensor ops with parameters per image.

The fast input path (engine.data.device_augment) sends uint8 crops to the training device and augments them
there. Images here are float32 (N, C, H, W) holding the integers 0..255 that timm's PIL ops see, and
each op rounds or truncates where Pillow does, so that it matches timm's PIL op on the same image and
parameter: exactly for the lookup-table and blend ops, within interpolation differences for the
geometric ones (torch's bicubic is Keys' a=-0.75, Pillow's affine bicubic another cubic; PSNR in
tests/engine/data/test_input_pipeline.py).

The random choices (op, whether it applies, magnitude, sign, erased box) are drawn on the host from a
CPU generator, one set per image, with timm's distributions; the device gets them in one copy and never
waits for the host, nor the host for the device.

timm's rand_augment_transform is imported inside functions, where a spec is built: importing timm costs
seconds, and the augmentation passes (and the processes that run only them) need none of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms.v2.functional import equalize as tv_equalize

from convbias.base.errors import ConfigError

LEVEL_DENOM = 10.0  # timm's _LEVEL_DENOM: magnitude M10 is an op's strongest level
GRAY_WEIGHTS = (19595, 38470, 7471)  # Pillow's RGB -> L, in 1/65536


@dataclass(frozen=True)
class OpContext:
    """What the geometric ops need besides the images: timm's fill color (img_mean) and interpolation."""

    fill: torch.Tensor  # (1, C, 1, 1), float, on the images' device
    interpolation: str  # 'bilinear' or 'bicubic' (grid_sample's names)


def _blend(degenerate: torch.Tensor, images: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Pillow's Image.blend(degenerate, image, factor) in float32, clipped then truncated as its C code does."""
    return torch.floor((degenerate + factor.view(-1, 1, 1, 1) * (images - degenerate)).clamp_(0, 255))


def _gray(images: torch.Tensor) -> torch.Tensor:
    """Pillow's RGB -> L, (19595 R + 38470 G + 7471 B + 2**15) >> 16: exact in float32 (every sum < 2**24)."""
    if images.shape[1] == 1:
        return images
    red, green, blue = (float(w) for w in GRAY_WEIGHTS)
    weighted = images[:, 0:1] * red + images[:, 1:2] * green + images[:, 2:3] * blue  # no host copy
    return torch.floor((weighted + 32768.0) / 65536.0)


def _apply_lut(images: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """A lookup table per image and channel, (N, C, 256), applied to (N, C, H, W)."""
    indices = images.long().flatten(2)
    return lut.to(images.dtype).gather(2, indices).view_as(images)


def color(images, factor, ctx):
    return _blend(_gray(images).expand_as(images), images, factor)


def contrast(images, factor, ctx):
    mean = torch.floor(_gray(images).double().mean((1, 2, 3)) + 0.5).float()  # int(ImageStat mean + 0.5)
    return _blend(mean.view(-1, 1, 1, 1).expand_as(images), images, factor)


def brightness(images, factor, ctx):
    return _blend(torch.zeros_like(images), images, factor)


def sharpness(images, factor, ctx):
    """Blend with ImageFilter.SMOOTH (3x3, centre 5, /13, rounded; border pixels kept, as Pillow's filter).
    The 3x3 sums are exact integers and (sum + 4 centre) / 13 is never within 1/26 of a half, so rounding it
    gives Pillow's result without its float32 kernel."""
    rows = images[..., :-2, :] + images[..., 1:-1, :] + images[..., 2:, :]
    box = rows[..., :-2] + rows[..., 1:-1] + rows[..., 2:]
    smooth = (box + 4.0 * images[..., 1:-1, 1:-1]) / 13.0
    degenerate = images.clone()
    degenerate[..., 1:-1, 1:-1] = torch.floor(smooth + 0.5).clamp_(0, 255)
    return _blend(degenerate, images, factor)


def auto_contrast(images, _arg, ctx):
    """ImageOps.autocontrast (cutoff 0): per channel, int(x * 255 / (hi - lo) - lo * scale), in float64 as Pillow."""
    low = images.amin((2, 3)).double()
    high = images.amax((2, 3)).double()
    scale = torch.full_like(high, 255.0) / (high - low).clamp(min=1.0)  # a true division (255 / t multiplies
    # by the reciprocal, which gives int(50.99..) = 50 where Pillow's 43 * 255 / 215 gives 51)
    levels = torch.arange(256, dtype=torch.float64, device=images.device)
    lut = torch.trunc(levels * scale[..., None] - (low * scale)[..., None]).clamp_(0, 255)
    lut = torch.where((high > low)[..., None], lut, levels)
    return _apply_lut(images, lut)


def equalize(images, _arg, ctx):
    """torchvision's equalize, which gives exactly ImageOps.equalize."""
    return tv_equalize(images.to(torch.uint8)).to(images.dtype)


# The point ops as functions of the levels (tensors or numpy arrays, the argument broadcast against them):
# the batched ops below apply them to images, the device passes to the levels 0..255 (a table per image).


def _inverted(levels, _arg):
    return 255.0 - levels


def _posterized(levels, bits):
    """Keeps the `bits` high bits; 0 bits gives black (the engine's posterize, see engine.data.factory)."""
    return levels - levels % 2.0 ** (8.0 - bits)


def _solarized(levels, threshold):
    return levels + (levels >= threshold) * (255.0 - 2.0 * levels)


def _solarized_add(levels, add):
    return levels + (levels < 128.0) * ((levels + add).clip(max=255.0) - levels)


def _point(levels_fn):
    """The batched op of a point function: its argument per image, broadcast over the image."""

    def op(images, arg, ctx):
        return levels_fn(images, arg.view(-1, 1, 1, 1))

    return op


invert, posterize, solarize, solarize_add = (_point(f) for f in (_inverted, _posterized, _solarized, _solarized_add))


def _warp(images: torch.Tensor, matrix: torch.Tensor, ctx: OpContext) -> torch.Tensor:
    """Pillow's Image.transform(AFFINE): `matrix` (N, 2, 3) maps output to input pixel coordinates (pixel
    centres at +0.5); input points outside the image take the fill color, inside ones clamp their taps at
    the border; the result is rounded."""
    n, channels, height, width = images.shape
    # theta = to_unit @ matrix @ from_unit in affine_grid's [-1, 1] coordinates, written out with scalars so
    # that no constant matrix is copied from the host (a synchronizing copy on a GPU)
    x, y, shift = matrix[..., 0] * (width / 2.0), matrix[..., 1] * (height / 2.0), matrix[..., 2]
    pixels = torch.stack([x, y, x + y + shift], -1)  # matrix @ from_unit, (N, 2, 3)
    theta = torch.stack([pixels[:, 0] * (2.0 / width), pixels[:, 1] * (2.0 / height)], 1)
    theta[..., 2] -= 1.0
    theta = theta.float()
    grid = F.affine_grid(theta, [n, channels, height, width], align_corners=False)
    sampled = F.grid_sample(images, grid, mode=ctx.interpolation, padding_mode="border", align_corners=False)
    inside = ((grid >= -1) & (grid < 1)).all(-1).unsqueeze(1)
    return torch.where(inside, torch.floor(sampled + 0.5).clamp_(0, 255), ctx.fill)


# The geometric ops' six coefficients (a, b, c, d, e, f) of Pillow's affine transform, from the argument
# (a tensor with xp = torch, an array with xp = numpy), the image's width and height.
Coefficients = Callable[[Any, int, int, ModuleType], list]


def _affine(rows: Coefficients):
    """The batched op of a geometric transform."""

    def op(images, arg, ctx):
        height, width = images.shape[-2:]
        coefficients = torch.stack(rows(arg.double(), width, height, torch), 1)
        return _warp(images, coefficients.view(-1, 2, 3), ctx)

    return op


def _rotation(degrees, width: int, height: int, xp: ModuleType) -> list:
    """Image.rotate's matrix (about the centre (w/2, h/2), counter-clockwise)."""
    angle = -xp.deg2rad(degrees)
    cos, sin = xp.cos(angle), xp.sin(angle)
    cx, cy = width / 2.0, height / 2.0
    return [cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy]


def _ones(arg, xp: ModuleType) -> tuple:
    return xp.ones_like(arg), xp.zeros_like(arg)


def _shear_x(f, w, h, xp):
    one, zero = _ones(f, xp)
    return [one, f, zero, zero, one, zero]


def _shear_y(f, w, h, xp):
    one, zero = _ones(f, xp)
    return [one, zero, zero, f, one, zero]


def _translate_x(pixels, w, h, xp):
    one, zero = _ones(pixels, xp)
    return [one, zero, pixels, zero, one, zero]


def _translate_y(pixels, w, h, xp):
    one, zero = _ones(pixels, xp)
    return [one, zero, zero, zero, one, pixels]


GEOMETRY: dict[str, Coefficients] = {
    "Rotate": _rotation,
    "ShearX": _shear_x,
    "ShearY": _shear_y,
    "TranslateX": _translate_x,
    "TranslateY": _translate_y,
    # timm's relative translations are a fraction of the image's width/height: the level is converted
    # to pixels here, as timm's translate_x_rel does
    "TranslateXRel": lambda pct, w, h, xp: _translate_x(pct * w, w, h, xp),
    "TranslateYRel": lambda pct, w, h, xp: _translate_y(pct * h, w, h, xp),
}
POINTS = {
    "Invert": _inverted,
    **{name: _posterized for name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal")},
    **{name: _solarized for name in ("Solarize", "SolarizeIncreasing")},
    "SolarizeAdd": _solarized_add,
}


OPS: dict[str, Callable[[torch.Tensor, torch.Tensor, OpContext], torch.Tensor]] = {
    "AutoContrast": auto_contrast,
    "Equalize": equalize,
    "Invert": invert,
    "Posterize": posterize,
    "PosterizeIncreasing": posterize,
    "PosterizeOriginal": posterize,
    "Solarize": solarize,
    "SolarizeIncreasing": solarize,
    "SolarizeAdd": solarize_add,
    "Color": color,
    "ColorIncreasing": color,
    "Contrast": contrast,
    "ContrastIncreasing": contrast,
    "Brightness": brightness,
    "BrightnessIncreasing": brightness,
    "Sharpness": sharpness,
    "SharpnessIncreasing": sharpness,
    **{name: _affine(rows) for name, rows in GEOMETRY.items()},
}


class Kind(IntEnum):
    """What a device pass does to an image (engine.data.augment_passes), one per image and layer."""

    NONE = 0  # no op drawn, or not applied
    LUT = 1  # a table of the levels (the point ops)
    WARP = 2  # an affine transform
    EQUALIZE = 3
    AUTOCONTRAST = 4
    BLEND_GRAY = 5  # Color: blend with the image's gray
    BLEND_SMOOTH = 6  # Sharpness: with its smoothed self
    BLEND_MEAN = 7  # Contrast: with its mean gray
    BLEND_ZERO = 8  # Brightness: with black


KINDS = {
    "AutoContrast": Kind.AUTOCONTRAST,
    "Equalize": Kind.EQUALIZE,
    **{name: Kind.LUT for name in POINTS},
    **{name: Kind.WARP for name in GEOMETRY},
    **{
        name: kind
        for base, kind in [
            ("Color", Kind.BLEND_GRAY),
            ("Sharpness", Kind.BLEND_SMOOTH),
            ("Contrast", Kind.BLEND_MEAN),
            ("Brightness", Kind.BLEND_ZERO),
        ]
        for name in (base, f"{base}Increasing")
    },
}
PLAN_WIDTH = 8  # a plan row: kind, blend factor, six affine coefficients


def layer_plans(
    names: tuple[str, ...], ops: np.ndarray, args: np.ndarray, width: int, height: int
) -> tuple[np.ndarray, np.ndarray]:
    """The sampled ops (RandAugmentSpec.sample's (op index, argument), (layers, N)) as the device passes take
    them: plan rows (layers, N, PLAN_WIDTH) and level tables (layers, N, 256), the identity where none applies."""
    layers, batch = ops.shape
    plans = np.zeros((layers, batch, PLAN_WIDTH))
    tables = np.broadcast_to(np.arange(256.0), (layers, batch, 256)).copy()
    for k in np.unique(ops[ops >= 0]):
        chosen = ops == k
        name, arg = names[k], args[chosen]
        plans[chosen, 0] = KINDS[name]
        plans[chosen, 1] = arg
        if name in GEOMETRY:
            plans[chosen, 2:] = np.stack(GEOMETRY[name](arg, width, height, np), 1)
        elif name in POINTS:
            tables[chosen] = POINTS[name](np.arange(256.0), arg[:, None])
    return plans, tables


def _signed(value: np.ndarray, negate: np.ndarray) -> np.ndarray:
    return np.where(negate, -value, value)


def _enhance(m, negate, hp):
    return (m / LEVEL_DENOM) * 1.8 + 0.1


def _enhance_increasing(m, negate, hp):
    return np.maximum(0.1, 1.0 + _signed((m / LEVEL_DENOM) * 0.9, negate))


def _posterize_level(m, negate, hp):
    return np.floor((m / LEVEL_DENOM) * 4)


def _solarize_level(m, negate, hp):
    return np.minimum(256, np.floor((m / LEVEL_DENOM) * 256))


# timm's LEVEL_TO_ARG vectorized: magnitude (clipped, >= 0, so int() is floor) and the per-image sign draw
# of timm's _randomly_negate -> the op's argument
LEVELS: dict[str, Callable[[np.ndarray, np.ndarray, dict], np.ndarray]] = {
    "AutoContrast": lambda m, negate, hp: np.zeros_like(m),
    "Equalize": lambda m, negate, hp: np.zeros_like(m),
    "Invert": lambda m, negate, hp: np.zeros_like(m),
    "Rotate": lambda m, negate, hp: _signed((m / LEVEL_DENOM) * 30.0, negate),
    "Posterize": _posterize_level,
    "PosterizeIncreasing": lambda m, negate, hp: 4 - _posterize_level(m, negate, hp),
    "PosterizeOriginal": lambda m, negate, hp: _posterize_level(m, negate, hp) + 4,
    "Solarize": _solarize_level,
    "SolarizeIncreasing": lambda m, negate, hp: 256 - _solarize_level(m, negate, hp),
    "SolarizeAdd": lambda m, negate, hp: np.minimum(128, np.floor((m / LEVEL_DENOM) * 110)),
    **{name: _enhance for name in ("Color", "Contrast", "Brightness", "Sharpness")},
    **{f"{name}Increasing": _enhance_increasing for name in ("Color", "Contrast", "Brightness", "Sharpness")},
    "ShearX": lambda m, negate, hp: _signed((m / LEVEL_DENOM) * 0.3, negate),
    "ShearY": lambda m, negate, hp: _signed((m / LEVEL_DENOM) * 0.3, negate),
    "TranslateX": lambda m, negate, hp: _signed((m / LEVEL_DENOM) * float(hp["translate_const"]), negate),
    "TranslateY": lambda m, negate, hp: _signed((m / LEVEL_DENOM) * float(hp["translate_const"]), negate),
    "TranslateXRel": lambda m, negate, hp: _signed((m / LEVEL_DENOM) * hp.get("translate_pct", 0.45), negate),
    "TranslateYRel": lambda m, negate, hp: _signed((m / LEVEL_DENOM) * hp.get("translate_pct", 0.45), negate),
}

_INTERPOLATIONS = {Image.Resampling.BILINEAR: "bilinear", Image.Resampling.BICUBIC: "bicubic"}


@dataclass(frozen=True)
class RandAugmentSpec:
    """A timm RandAugment configuration, as timm itself parses it (`from_timm`)."""

    names: tuple[str, ...]
    num_layers: int
    prob: float
    magnitude: float
    magnitude_std: float
    magnitude_max: float
    choice_weights: tuple[float, ...] | None
    fill: tuple[int, ...]
    interpolation: str
    hparams: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_timm(cls, config: str, hparams: dict[str, Any]) -> RandAugmentSpec:
        """Built by timm's rand_augment_transform (same parsing, same op set); ConfigError if an op or setting
        has no batched form here."""
        if not config.startswith("rand"):
            raise ConfigError(f"auto-augment {config!r}: only RandAugment ('rand-...') has a batched device form")
        from timm.data.auto_augment import rand_augment_transform

        transform = rand_augment_transform(config, dict(hparams))
        missing = sorted({op.name for op in transform.ops} - set(OPS))
        if missing:
            raise ConfigError(f"auto-augment {config!r}: no batched form of {', '.join(missing)}")
        op = transform.ops[0]
        resample = op.kwargs["resample"]
        if resample not in _INTERPOLATIONS:
            raise ConfigError(f"auto-augment {config!r}: interpolation {resample!r} has no batched form")
        weights = transform.choice_weights
        return cls(
            names=tuple(o.name for o in transform.ops),
            num_layers=transform.num_layers,
            prob=op.prob,
            magnitude=float(op.magnitude),
            magnitude_std=float(op.magnitude_std),
            magnitude_max=float(op.magnitude_max or LEVEL_DENOM),
            choice_weights=None if weights is None else tuple(float(w) for w in weights),
            fill=tuple(int(v) for v in np.atleast_1d(op.kwargs["fillcolor"])),
            interpolation=_INTERPOLATIONS[resample],
            hparams=dict(op.hparams),
        )

    def sample(self, batch: int, generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(op index, op argument) per layer and image, each (num_layers, batch); index -1: not applied.
        timm's draws per image: ops uniform with replacement (weighted without), apply with `prob`,
        magnitude N(m, std) (uniform(0, m) for std inf) clipped to [0, max], sign negated with 1/2."""
        count = len(self.names)
        if self.choice_weights is None:
            ops = torch.randint(count, (batch, self.num_layers), generator=generator)
        else:
            weights = torch.tensor(self.choice_weights, dtype=torch.float64).expand(batch, count)
            ops = torch.multinomial(weights, self.num_layers, replacement=False, generator=generator)
        shape = (batch, self.num_layers)
        applies = torch.rand(shape, generator=generator, dtype=torch.float64) <= self.prob
        magnitude = torch.full(shape, self.magnitude, dtype=torch.float64)
        if math.isinf(self.magnitude_std):
            magnitude = torch.rand(shape, generator=generator, dtype=torch.float64) * self.magnitude
        elif self.magnitude_std > 0:
            magnitude += self.magnitude_std * torch.randn(shape, generator=generator, dtype=torch.float64)
        negate = (torch.rand(shape, generator=generator, dtype=torch.float64) > 0.5).numpy()
        magnitude = magnitude.clamp(0.0, self.magnitude_max).numpy()
        ops = ops.numpy()
        args = np.zeros(shape)
        for k in np.unique(ops):
            chosen = ops == k
            args[chosen] = LEVELS[self.names[k]](magnitude[chosen], negate[chosen], self.hparams)
        return np.where(applies.numpy(), ops, -1).T, args.T


@dataclass(frozen=True)
class ErasingSpec:
    """timm's RandomErasing settings (one box per image, as the engine's recipe uses)."""

    probability: float
    mode: str = "pixel"  # 'pixel': per-pixel normal noise; 'rand': one normal color per box; 'const': 0
    min_area: float = 0.02
    max_area: float = 1 / 3
    min_aspect: float = 0.3

    def sample(self, batch: int, height: int, width: int, generator: torch.Generator) -> np.ndarray:
        """(top, left, h, w) per image, h = w = 0 for none: erase with `probability`, then timm's 10
        attempts at an area in [min_area, max_area] of the image and a log-uniform aspect ratio."""
        draws = torch.rand((batch, 23), generator=generator, dtype=torch.float64).numpy()
        erase = draws[:, 0] <= self.probability
        area = (self.min_area + (self.max_area - self.min_area) * draws[:, 1:11]) * height * width
        low, high = math.log(self.min_aspect), math.log(1 / self.min_aspect)
        aspect = np.exp(low + (high - low) * draws[:, 11:21])
        h = np.round(np.sqrt(area * aspect)).astype(np.int64)
        w = np.round(np.sqrt(area / aspect)).astype(np.int64)
        fits = (w < width) & (h < height)
        first = fits.argmax(1)
        h, w = h[np.arange(batch), first], w[np.arange(batch), first]
        keep = erase & fits.any(1)
        top = np.floor(draws[:, 21] * (height - h + 1)).astype(np.int64)
        left = np.floor(draws[:, 22] * (width - w + 1)).astype(np.int64)
        return np.stack([top, left, h, w], 1) * keep[:, None]


def erasing_noise(mode: str, boxes: np.ndarray, channels: int, generator: torch.Generator) -> torch.Tensor:
    """The values `erase` fills the (N, 4) boxes (on the host) with, drawn from `generator` (on the device):
    'pixel': one per erased pixel and channel, image by image in row-major order; 'rand': one per image and
    channel; 'const': none (zeros)."""
    count = {"pixel": int((boxes[:, 2] * boxes[:, 3]).sum()) * channels, "rand": len(boxes) * channels}.get(mode, 0)
    return torch.empty(count, device=generator.device).normal_(generator=generator)


def erase(images: torch.Tensor, boxes: torch.Tensor, mode: str, noise: torch.Tensor) -> torch.Tensor:
    """Fills each image's box ((N, 4) top, left, h, w) with `erasing_noise`'s values, as timm's RandomErasing."""
    n, channels, height, width = images.shape
    rows = torch.arange(height, device=images.device).view(1, height, 1)
    cols = torch.arange(width, device=images.device).view(1, 1, width)
    top, left, h, w = (v.view(n, 1, 1) for v in boxes.unbind(1))
    mask = ((rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)).unsqueeze(1)
    if mode == "pixel":
        return images.masked_scatter_(mask.expand_as(images), noise)
    if mode == "rand":
        return torch.where(mask, noise.view(n, channels, 1, 1), images)
    return images.masked_fill_(mask, 0.0)
