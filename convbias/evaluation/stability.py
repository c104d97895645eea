"""Relative stability to diffeomorphisms R_f = D_f / G_f (Petrini et al. 2021, eq. 4-5), for any model.

    D_f = < ||f(tau x) - f(x)||^2 >_{x, tau}     G_f = < ||f(x + eta) - f(x)||^2 >_{x, eta}

over test images x, one max-entropy diffeomorphism tau (`convbias.evaluation.diffeo`) and one noise eta per
image, eta uniform on the sphere of radius < ||tau x - x|| >. < . > is the median (default, the paper's
main text) or the mean, used for the radius too, so that the identity map has R_f = 1 exactly (median).
With `normalize`, D_f and G_f are divided by < ||f(x) - f(z)||^2 > over pairs of consecutive test images
(R_f is unchanged). f is the logits and, with `per_layer`, every block's representation from the model's
`forward_intermediates` (timm's feature API) or, for a model without it, every activation module's output.

Images are processed `chunk_size` at a time: memory does not grow with their number beyond the images
themselves and a few floats per image. Fields and noise are drawn image by image from one seeded CPU
generator, so the result does not depend on the chunk size or the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .diffeo import INTERPOLATIONS, check_cut, deform, displacement_range, sample_fields, temperature, temperature_range

__all__ = ["STATISTICS", "Stability", "diagnostic", "has_layers", "relative_stability", "representations"]

STATISTICS = ("median", "mean")
DIAGNOSTIC_DELTA = 1.0  # R_f of the paper: delta = 1 pixel, cut-off c = 3
DIAGNOSTIC_CUT = 3
_ACTIVATIONS = (nn.ReLU, nn.GELU, nn.SiLU, nn.ELU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.Hardswish, nn.Mish)


@dataclass
class Stability:
    """D_f, G_f, R_f of the logits, and per depth (`layers`: one (D, G, R) per block, input side first)."""

    D: float
    G: float
    R: float
    layers: list[tuple[float, float, float]] = field(default_factory=list)
    delta: float = float("nan")
    cut: int = 0
    T: float = float("nan")
    noise_radius: float = float("nan")
    statistic: str = "median"
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


def _check_inputs(images, statistic: str, chunk_size: int, interpolation: str, cut: int) -> None:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[0] == 0:
        raise ValueError(
            f"images must be a non-empty (N, C, H, W) tensor, got "
            f"{tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__}"
        )
    if statistic not in STATISTICS:
        raise ValueError(f"statistic={statistic!r} must be one of {STATISTICS}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer")
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation={interpolation!r} must be one of {INTERPOLATIONS}")
    check_cut(cut, images.shape[-2:])


@torch.no_grad()
def relative_stability(
    model: nn.Module,
    images: torch.Tensor,
    delta: float | None = DIAGNOSTIC_DELTA,
    cut: int = DIAGNOSTIC_CUT,
    T: float | None = None,
    statistic: str = "median",
    normalize: bool = False,
    per_layer: bool = False,
    chunk_size: int = 64,
    seed: int = 0,
    interpolation: str = "bilinear",
) -> Stability:
    """R_f of `model` on `images` (N, C, H, W), as the model sees them (normalized), at typical displacement
    `delta` pixels (or temperature `T`) and cut-off `cut`. One diffeomorphism and one noise per image."""
    _check_inputs(images, statistic, chunk_size, interpolation, cut)
    if per_layer and not has_layers(model):
        raise ValueError(
            f"per-layer R_f needs a model with forward_intermediates or activation modules; "
            f"{type(model).__name__} has neither"
        )
    if normalize and images.shape[0] < 2:
        raise ValueError(f"normalize=True needs at least 2 images (pairs of test images), got {images.shape[0]}")
    size = images.shape[-2:]
    if T is None:
        if delta is None:
            raise ValueError("give delta (pixels) or T")
        T = temperature(delta, cut, size)
    else:
        t_min, t_max = temperature_range(cut, size)
        if not t_min <= T <= t_max:
            raise ValueError(
                f"T={T!r} is outside the diffeomorphism region [{t_min:.3g}, {t_max:.3g}] for "
                f"cut={cut} on a {size[0]}x{size[1]} image"
            )
    count = images.shape[0]
    generator = torch.Generator().manual_seed(seed)
    fields = sample_fields(count, cut, generator)
    params = next(iter(model.parameters()), None)
    device = params.device if params is not None else images.device
    chunks = [slice(i, min(i + chunk_size, count)) for i in range(0, count, chunk_size)]

    def deformed(part: slice, x: torch.Tensor) -> torch.Tensor:
        return deform(x, T, cut, coefficients=fields[part], interpolation=interpolation)

    # pass 1: the noise radius < ||tau x - x|| >, before any noise is drawn
    moved = torch.cat(
        [
            deformed(part, x).sub_(x).flatten(1).norm(dim=1).double().cpu()
            for part, x in ((part, images[part].to(device)) for part in chunks)
        ]
    )
    radius = _statistic(moved, statistic)

    # pass 2: f(x), f(tau x), f(x + eta), one at a time: beyond evaluating a chunk, one perturbed copy of it
    was_training = model.training
    model.eval()
    diffeo, noise, pairs = [], [], []
    previous: list[torch.Tensor] | None = None
    try:
        for part in chunks:
            x = images[part].to(device)
            reference = representations(model, x, per_layer)
            deformed_x = deformed(part, x)
            diffeo.append(_squared_distances(representations(model, deformed_x, per_layer), reference))
            del deformed_x
            noisy = torch.empty_like(x)  # x + eta, built in one buffer
            for i in range(x.shape[0]):
                noisy[i] = torch.randn(x.shape[1:], generator=generator)
            noisy.mul_((radius / noisy.flatten(1).norm(dim=1).clamp_min(1e-30)).view(-1, 1, 1, 1)).add_(x)
            noise.append(_squared_distances(representations(model, noisy, per_layer), reference))
            del noisy
            if normalize:  # pairs (x_i, x_{i-1}), across chunk boundaries too
                joined = [torch.cat([p, r]) for p, r in zip(previous, reference)] if previous else reference
                if joined[0].shape[0] > 1:
                    pairs.append(_squared_distances([j[1:] for j in joined], [j[:-1] for j in joined]))
                previous = [r[-1:] for r in reference]
    finally:
        model.train(was_training)
    diffeo_d, noise_d = torch.cat(diffeo, dim=1), torch.cat(noise, dim=1)
    scale = torch.ones(diffeo_d.shape[0], dtype=torch.float64)
    if normalize:
        scale = torch.tensor([_statistic(row, statistic) for row in torch.cat(pairs, dim=1)], dtype=torch.float64)
    values = []
    for row_d, row_g, s in zip(diffeo_d, noise_d, scale.tolist()):
        d, g = _statistic(row_d, statistic), _statistic(row_g, statistic)
        d, g = (_ratio(d, s), _ratio(g, s)) if normalize else (d, g)
        values.append((d, g, _ratio(d, g)))
    return Stability(
        *values[-1],
        layers=values[:-1],
        delta=delta if delta is not None else float("nan"),
        cut=cut,
        T=T,
        noise_radius=radius,
        statistic=statistic,
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
