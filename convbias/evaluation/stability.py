"""Relative stability to diffeomorphisms R_f = D_f / G_f (Petrini et al. 2021, eq. 4-5), for any model.

    D_f = < ||f(tau x) - f(x)||^2 >_{x, tau}     G_f = < ||f(x + eta) - f(x)||^2 >_{x, eta}

over test images x, max-entropy diffeomorphisms tau (`convbias.evaluation.diffeo`, on the mode set `modes`)
and noises eta uniform on a sphere. How < . > and the noise radius are taken is the `convention`
(`CONVENTIONS`):

- "published" (default), as the authors' code computes them (diffeo-sota, results/utils.py): < . > is the
  mean over images, and each image's noise has the norm of its own displacement, ||eta|| = ||tau x - x||;
  with `normalize`, the scale is the mean of ||f(x) - f(z)||^2 over all ordered pairs of test images.
- "robust": < . > is the median over images, and one noise radius, the median of ||tau x - x||, is shared by
  all images (the paper's sec. 3 wording); with `normalize`, the median over pairs of consecutive test
  images. Less sensitive to a few images with a large ||Delta f||^2.

Both give R_f = 1 exactly for the identity map. `draws` independent diffeomorphism-and-noise draws per image
give D_f, G_f and R_f with their standard errors over draws (R_f = D_f / G_f of the draw-averaged parts).
f is the logits and, with `per_layer`, every block's representation from the model's
`forward_intermediates` (timm's feature API) or, for a model without it, every activation module's output.

Images are processed `chunk_size` at a time: memory does not grow with their number beyond the images
themselves and a few floats per image and draw. Each draw has its own CPU generator (seeded from `seed`)
that draws every field first, then the noises image by image, so the result does not depend on the chunk
size or the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from convbias.base.errors import ConfigError

from .diffeo import (
    INTERPOLATIONS,
    check_cut,
    check_modes,
    deform,
    displacement_range,
    sample_fields,
    temperature,
    temperature_range,
)

__all__ = [
    "CONVENTIONS",
    "Convention",
    "Stability",
    "diagnostic",
    "has_layers",
    "relative_stability",
    "representations",
]

DIAGNOSTIC_DELTA = 1.0  # R_f of the paper: delta = 1 pixel, cut-off c = 3
DIAGNOSTIC_CUT = 3
_ACTIVATIONS = (nn.ReLU, nn.GELU, nn.SiLU, nn.ELU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.Hardswish, nn.Mish)
_Deform = Callable[[int, slice, torch.Tensor], torch.Tensor]  # (draw, chunk, images of the chunk) -> tau x


@dataclass(frozen=True)
class Convention:
    """How the averages of eq. 4-5 are taken."""

    statistic: str  # over images: "mean" or "median"
    noise_radius: str  # "per_image": ||eta|| = ||tau x - x||; "shared": the statistic of ||tau x - x||
    pairs: str  # normalization: "all" ordered pairs (mean) or "consecutive" pairs (median)


CONVENTIONS = {
    "published": Convention(statistic="mean", noise_radius="per_image", pairs="all"),
    "robust": Convention(statistic="median", noise_radius="shared", pairs="consecutive"),
}


@dataclass
class Stability:
    """D_f, G_f, R_f of the logits and their standard errors over draws (NaN for one draw), and per depth
    (`layers`: one (D, G, R) per block, input side first; `layers_se` their standard errors)."""

    D: float
    G: float
    R: float
    D_se: float = float("nan")
    G_se: float = float("nan")
    R_se: float = float("nan")
    layers: list[tuple[float, float, float]] = field(default_factory=list)
    layers_se: list[tuple[float, float, float]] = field(default_factory=list)
    delta: float = float("nan")
    cut: int = 0
    T: float = float("nan")
    noise_radius: float = float("nan")  # mean over draws of the shared radius, or of the mean per-image radius
    convention: str = "published"
    modes: str = "published"
    draws: int = 1
    normalized: bool = False
    count: int = 0

    def as_dict(self, prefix: str = "rf") -> dict[str, float]:
        """Flat {prefix: R, prefix_D, prefix_G, prefix_layer<i>: R_i}; an undefined R_f is NaN."""
        out = {prefix: self.R, f"{prefix}_D": self.D, f"{prefix}_G": self.G}
        out.update({f"{prefix}_layer{i}": r for i, (_, _, r) in enumerate(self.layers)})
        return out


def _ratio(num: float, den: float) -> float:
    """num / den, NaN (undefined) when the denominator vanishes: a constant f has no R_f."""
    return num / den if den > 0 and math.isfinite(den) else float("nan")


def _statistic(values: torch.Tensor, statistic: str) -> float:
    values = values.double()
    return float(values.quantile(0.5) if statistic == "median" else values.mean())


def _mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (NaN for one value); NaN if any value is NaN."""
    tensor = torch.tensor(values, dtype=torch.float64)
    se = float(tensor.std() / math.sqrt(len(values))) if len(values) > 1 else float("nan")
    return float(tensor.mean()), se


def has_layers(model: nn.Module) -> bool:
    """Whether per-layer R_f applies: timm's feature API, or at least one activation module to hook."""
    return (hasattr(model, "forward_intermediates") and hasattr(model, "forward_head")) or any(
        isinstance(m, _ACTIVATIONS) for m in model.modules()
    )


def representations(model: nn.Module, x: torch.Tensor, per_layer: bool) -> list[torch.Tensor]:
    """[block outputs..., logits] (just [logits] without `per_layer`), each flattened to (B, -1)."""
    if not per_layer:
        return [model(x).flatten(1)]
    if hasattr(model, "forward_intermediates") and hasattr(model, "forward_head"):
        final, intermediates = model.forward_intermediates(x)
        return [t.flatten(1) for t in intermediates] + [model.forward_head(final).flatten(1)]
    captured: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().flatten(1).clone()))
        for m in model.modules()
        if isinstance(m, _ACTIVATIONS)
    ]
    try:
        logits = model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return captured + [logits.flatten(1)]


def _squared_distances(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> torch.Tensor:
    """(depth, B) ||out - ref||^2 per representation and image."""
    return torch.stack([(o - r).pow_(2).sum(1) for o, r in zip(outputs, reference)]).double().cpu()


def _check_inputs(images, convention, chunk_size: int, interpolation: str, cut: int, modes: str, draws) -> None:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[0] == 0:
        raise ConfigError(
            f"images must be a non-empty (N, C, H, W) tensor, got "
            f"{tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__}"
        )
    if not isinstance(convention, Convention) and convention not in CONVENTIONS:
        raise ConfigError(f"convention={convention!r} must be one of {tuple(CONVENTIONS)} or a Convention")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"chunk_size={chunk_size!r} must be a positive integer")
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ConfigError(f"draws={draws!r} must be a positive integer")
    if interpolation not in INTERPOLATIONS:
        raise ConfigError(f"interpolation={interpolation!r} must be one of {INTERPOLATIONS}")
    check_modes(modes)
    check_cut(cut, images.shape[-2:])


def _noise(shape: torch.Size, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` directions uniform on the unit sphere, drawn image by image from `generator`."""
    noise = torch.stack([torch.randn(shape, generator=generator) for _ in range(count)])
    return noise.div_(noise.flatten(1).norm(dim=1).clamp_min(1e-30).view(-1, *[1] * len(shape)))


class _PairScale:
    """Accumulates < ||f(x) - f(z)||^2 > over test images, chunk by chunk: the mean over all N^2 ordered pairs,
    2 (<||f||^2> - ||<f>||^2), or the median over the consecutive pairs (x_i, x_{i-1})."""

    def __init__(self, pairs: str):
        self.pairs = pairs
        self.sums: list[torch.Tensor] = []
        self.squares: list[float] = []
        self.count = 0
        self.consecutive: list[torch.Tensor] = []
        self.previous: list[torch.Tensor] | None = None

    def add(self, reference: list[torch.Tensor]) -> None:
        if self.pairs == "all":
            flat = [r.double() for r in reference]
            if not self.sums:
                self.sums = [f.sum(0) for f in flat]
                self.squares = [float(f.pow(2).sum()) for f in flat]
            else:
                self.sums = [s + f.sum(0) for s, f in zip(self.sums, flat)]
                self.squares = [q + float(f.pow(2).sum()) for q, f in zip(self.squares, flat)]
            self.count += reference[0].shape[0]
            return
        joined = [torch.cat([p, r]) for p, r in zip(self.previous, reference)] if self.previous else reference
        if joined[0].shape[0] > 1:
            self.consecutive.append(_squared_distances([j[1:] for j in joined], [j[:-1] for j in joined]))
        self.previous = [r[-1:] for r in reference]

    def scales(self) -> list[float]:
        if self.pairs == "all":
            return [
                2 * (q / self.count - float((s / self.count).pow(2).sum())) for s, q in zip(self.sums, self.squares)
            ]
        return [_statistic(row, "median") for row in torch.cat(self.consecutive, dim=1)]


def _temperature(delta: float | None, T: float | None, cut: int, size: torch.Size) -> float:
    """T of typical displacement `delta` pixels, or the given T once checked to give a diffeomorphism."""
    if T is None:
        if delta is None:
            raise ConfigError("give delta (pixels) or T")
        return temperature(delta, cut, size)
    t_min, t_max = temperature_range(cut, size)
    if not t_min <= T <= t_max:
        raise ConfigError(
            f"T={T!r} is outside the diffeomorphism region [{t_min:.3g}, {t_max:.3g}] for "
            f"cut={cut} on a {size[0]}x{size[1]} image"
        )
    return T


def _shared_radii(
    images: torch.Tensor, chunks: list[slice], device: torch.device, deformed: _Deform, draws: int, statistic: str
) -> list[float]:
    """The shared noise radius of each draw, the statistic of ||tau x - x|| over the images: computed before any
    noise is drawn, so that every image's noise has it."""
    moved = [[] for _ in range(draws)]
    for part in chunks:
        x = images[part].to(device)
        for k in range(draws):
            moved[k].append(deformed(k, part, x).sub_(x).flatten(1).norm(dim=1).double().cpu())
    return [_statistic(torch.cat(m), statistic) for m in moved]


def _squared_changes(
    model: nn.Module,
    images: torch.Tensor,
    chunks: list[slice],
    device: torch.device,
    deformed: _Deform,
    generators: list[torch.Generator],
    shared: list[float] | None,
    per_layer: bool,
    scale: _PairScale | None,
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Per draw, the chunks' (depth, B) ||f(tau x) - f(x)||^2 and ||f(x + eta) - f(x)||^2, and the noise radii.

    f(x) once per chunk, then per draw f(tau x) and f(x + eta): beyond a chunk's evaluation, one perturbed copy
    is held at a time. The model is measured in eval mode and left in the mode it had; `scale` (normalization)
    accumulates the chunks' f(x)."""
    draws = len(generators)
    was_training = model.training
    model.eval()
    diffeo, noise = [[] for _ in range(draws)], [[] for _ in range(draws)]
    radii = [[] for _ in range(draws)]
    try:
        for part in chunks:
            x = images[part].to(device)
            reference = representations(model, x, per_layer)
            for k in range(draws):
                deformed_x = deformed(k, part, x)
                radius = deformed_x.sub(x).flatten(1).norm(dim=1)
                diffeo[k].append(_squared_distances(representations(model, deformed_x, per_layer), reference))
                del deformed_x
                if shared is not None:
                    radius = torch.full_like(radius, shared[k])
                radii[k].append(radius.double().cpu())
                noisy = _noise(x.shape[1:], x.shape[0], generators[k]).to(device)
                noisy.mul_(radius.view(-1, *[1] * (x.dim() - 1)).to(noisy.dtype)).add_(x)
                noise[k].append(_squared_distances(representations(model, noisy, per_layer), reference))
                del noisy
            if scale is not None:
                scale.add(reference)
    finally:
        model.train(was_training)
    return diffeo, noise, radii


def _summarize(
    diffeo: list[list[torch.Tensor]],
    noise: list[list[torch.Tensor]],
    norms: list[float],
    statistic: str,
    normalize: bool,
) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]]]:
    """Per depth, (D, G, R) of the draw-averaged D and G, and the standard errors over draws of D, G and R."""
    per_draw = []  # per draw, per depth: (D, G, R)
    for diffeo_k, noise_k in zip(diffeo, noise):
        rows_d, rows_g = torch.cat(diffeo_k, dim=1), torch.cat(noise_k, dim=1)
        values = []
        for row_d, row_g, s in zip(rows_d, rows_g, norms):
            d, g = _statistic(row_d, statistic), _statistic(row_g, statistic)
            d, g = (_ratio(d, s), _ratio(g, s)) if normalize else (d, g)
            values.append((d, g, _ratio(d, g)))
        per_draw.append(values)
    summary, errors = [], []
    for i in range(len(norms)):
        (d, d_se), (g, g_se) = (_mean_se([v[i][j] for v in per_draw]) for j in (0, 1))
        _, r_se = _mean_se([v[i][2] for v in per_draw])
        summary.append((d, g, _ratio(d, g)))
        errors.append((d_se, g_se, r_se))
    return summary, errors


@torch.no_grad()
def relative_stability(
    model: nn.Module,
    images: torch.Tensor,
    delta: float | None = DIAGNOSTIC_DELTA,
    cut: int = DIAGNOSTIC_CUT,
    T: float | None = None,
    convention: str | Convention = "published",
    modes: str = "published",
    draws: int = 1,
    normalize: bool = False,
    per_layer: bool = False,
    chunk_size: int = 64,
    seed: int = 0,
    interpolation: str = "bilinear",
) -> Stability:
    """R_f of `model` on `images` (N, C, H, W), as the model sees them (normalized), at typical displacement
    `delta` pixels (or temperature `T`) and cut-off `cut`, over `draws` diffeomorphism-and-noise draws per
    image, in `convention` ("published" or "robust", see the module docstring)."""
    _check_inputs(images, convention, chunk_size, interpolation, cut, modes, draws)
    rule = convention if isinstance(convention, Convention) else CONVENTIONS[convention]
    name = (
        convention
        if isinstance(convention, str)
        else next((k for k, v in CONVENTIONS.items() if v == rule), repr(rule))
    )
    if per_layer and not has_layers(model):
        raise ConfigError(
            f"per-layer R_f needs a model with forward_intermediates or activation modules; "
            f"{type(model).__name__} has neither"
        )
    if normalize and images.shape[0] < 2:
        raise ConfigError(f"normalize=True needs at least 2 images (pairs of test images), got {images.shape[0]}")
    T = _temperature(delta, T, cut, images.shape[-2:])
    count = images.shape[0]
    draw_seeds = torch.randint(0, 2**62, (draws,), generator=torch.Generator().manual_seed(seed)).tolist()
    generators = [torch.Generator().manual_seed(s) for s in draw_seeds]
    fields = [sample_fields(count, cut, g, modes) for g in generators]
    params = next(iter(model.parameters()), None)
    device = params.device if params is not None else images.device
    chunks = [slice(i, min(i + chunk_size, count)) for i in range(0, count, chunk_size)]

    def deformed(k: int, part: slice, x: torch.Tensor) -> torch.Tensor:
        return deform(x, T, cut, coefficients=fields[k][part], interpolation=interpolation)

    shared = None
    if rule.noise_radius == "shared":
        shared = _shared_radii(images, chunks, device, deformed, draws, rule.statistic)
    scale = _PairScale(rule.pairs) if normalize else None
    diffeo, noise, radii = _squared_changes(
        model, images, chunks, device, deformed, generators, shared, per_layer, scale
    )
    depth = diffeo[0][0].shape[0]
    norms = scale.scales() if normalize else [1.0] * depth
    summary, errors = _summarize(diffeo, noise, norms, rule.statistic, normalize)
    return Stability(
        *summary[-1],
        *errors[-1],
        layers=summary[:-1],
        layers_se=errors[:-1],
        delta=delta if delta is not None else float("nan"),
        cut=cut,
        T=T,
        noise_radius=float(torch.stack([torch.cat(r).mean() for r in radii]).mean()),
        convention=name,
        modes=modes,
        draws=draws,
        normalized=normalize,
        count=count,
    )


def diagnostic(model: nn.Module, images: torch.Tensor) -> dict[str, float]:
    """The engine's per-evaluation diagnostic: R_f at delta = 1, c = 3 of the logits and of every block, on the
    run's fixed diagnostics images (their number, `--diagnostics-images`, sets the cost). {} for images too
    small for such a diffeomorphism (e.g. the native 8x8 digits: delta <= 0.85 pixel at c = 3)."""
    if displacement_range(DIAGNOSTIC_CUT, images.shape[-2:])[1] < DIAGNOSTIC_DELTA:
        return {}
    return relative_stability(model, images, per_layer=has_layers(model)).as_dict("rf")
