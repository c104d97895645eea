"""Max-entropy diffeomorphisms: boundary conditions, the delta(T, c) law, resampling against explicit formulas,
seeds, the augmentation transform, and bad input."""

import math

import pytest
import torch

from convbias.evaluation import diffeo

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("size", [(20, 33), (17, 17)])
def test_fields_vanish_on_the_frame(size):
    coefficients = diffeo.sample_fields(8, 5, torch.Generator().manual_seed(0))
    field = diffeo.displacement_field(coefficients, 0.01, size)
    assert field.shape == (8, 2, *size)
    frame = torch.cat([field[..., 0, :], field[..., -1, :], field[..., :, 0], field[..., :, -1]], dim=-1)
    assert frame.abs().max() < 1e-5 * field.abs().max()
    assert field[..., 1:-1, 1:-1].abs().amin(dim=(-1, -2)).lt(field.abs().amax(dim=(-1, -2))).all()


@pytest.mark.parametrize("size", [(61, 61), (61, 91)])
def test_center_displacement_follows_the_formula_for_large_cut(size):
    """delta^2 = (pi/4) n^2 T ln c, n^2 = (H^2 + W^2) / 2, checked at the center pixel over 4,000 fields."""
    cut, delta = 30, 0.6
    T = diffeo.temperature(delta, cut, size)
    assert diffeo.typical_displacement(T, cut, size) == pytest.approx(delta)
    generator = torch.Generator().manual_seed(1)
    center = [
        diffeo.displacement_field(diffeo.sample_fields(1000, cut, generator), T, size)[:, :, size[0] // 2, size[1] // 2]
        for _ in range(4)
    ]
    empirical = torch.cat(center).pow(2).sum(1).mean().sqrt().item()
    assert empirical == pytest.approx(delta, rel=0.10)


def _explicit_gaussian(image, field, sigma=diffeo.GAUSSIAN_SIGMA):
    """App. C, dense: every pixel weighted by exp(-d^2 / 2 sigma^2) around the source point, normalized."""
    height, width = image.shape[-2:]
    y, x = torch.meshgrid(
        torch.arange(height, dtype=torch.float64), torch.arange(width, dtype=torch.float64), indexing="ij"
    )
    xn, yn = (x - field[0]).clamp(0, width - 1), (y - field[1]).clamp(0, height - 1)
    weight = torch.exp(-((xn[:, :, None, None] - x) ** 2 + (yn[:, :, None, None] - y) ** 2) / (2 * sigma**2))
    weight = weight / weight.sum((2, 3), keepdim=True)
    return (weight * image.double()[..., None, None, :, :]).sum((-1, -2)).float()


@pytest.mark.parametrize("interpolation, tol", [("bilinear", 1e-5), ("gaussian", 2e-4)])
def test_resampling_matches_the_explicit_formula(interpolation, tol, authors_remap):
    explicit = authors_remap if interpolation == "bilinear" else _explicit_gaussian
    size, cut = (12, 15), 3
    images = torch.rand(3, 2, *size, generator=torch.Generator().manual_seed(2))
    coefficients = diffeo.sample_fields(3, cut, torch.Generator().manual_seed(3))
    T = diffeo.temperature_range(cut, size)[1]
    out = diffeo.deform(images, T, cut, coefficients=coefficients, interpolation=interpolation)
    fields = diffeo.displacement_field(coefficients, T, size)
    assert fields.abs().max() > 1.0  # displacements beyond one pixel: the corners/windows matter
    for image, field, result in zip(images, fields, out):
        torch.testing.assert_close(result, explicit(image, field), atol=tol, rtol=0)


def test_seeds_reproduce_and_differ():
    images = torch.rand(4, 3, 16, 16)
    T = diffeo.temperature(1.0, 3, 16)
    first, again, other = (diffeo.deform(images, T, 3, generator=torch.Generator().manual_seed(s)) for s in (5, 5, 6))
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    assert not torch.allclose(first, images)


def test_augmentation_keeps_the_frame_and_moves_the_inside():
    torch.manual_seed(0)
    image = torch.rand(3, 24, 30)
    transform = diffeo.Diffeo(delta=(1.0, 1.5), cut=(2, 4))
    out = transform(image)
    assert out.shape == image.shape
    for edge in (lambda t: t[..., 0, :], lambda t: t[..., -1, :], lambda t: t[..., :, 0], lambda t: t[..., :, -1]):
        torch.testing.assert_close(edge(out), edge(image))
    assert (out - image)[..., 1:-1, 1:-1].abs().mean() > 0.05
    assert torch.equal(diffeo.Diffeo(p=0.0)(image), image)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: diffeo.temperature(3.5, 3, 28), r"delta=3.5 is outside the diffeomorphism region \[0.5, 2.97\]"),
        (lambda: diffeo.temperature(0.2, 3, 28), r"delta=0.2 is outside"),
        (lambda: diffeo.temperature_range(9, 8), r"cut=9 must be an integer in \[2, 8\]"),
        (lambda: diffeo.temperature_range(6, 8), r"cut=6 is too large for a 8x8 image"),
        (lambda: diffeo.deform(torch.rand(1, 1, 28, 28), 0.5, 3), r"T=0.5 is outside the diffeomorphism region"),
        (lambda: diffeo.deform(torch.rand(0, 1, 28, 28), 1e-3, 3), r"images must be a non-empty"),
        (lambda: diffeo.deform(torch.rand(1, 1, 28, 28), 1e-3, 3, interpolation="cubic"), r"interpolation='cubic'"),
        (lambda: diffeo.Diffeo(delta=(0.1, 1.0)), r"delta=\(0.1, 1.0\)"),
    ],
)
def test_bad_input_names_the_value_and_the_range(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_temperature_range_formulas():
    t_min, t_max = diffeo.temperature_range(5, 64)
    assert t_min == pytest.approx(1 / (math.pi * 64**2 * math.log(5)))
    assert t_max == pytest.approx(4 / (math.pi**3 * 25 * math.log(5)))
    assert diffeo.displacement_range(5, 64) == pytest.approx((0.5, 64 / (math.pi * 5)))


def test_mode_sets_count_the_published_and_disc_modes():
    """The authors' library keeps sqrt(i^2 + j^2) < c + 1/2: 6 and 19 modes at c = 3 and 5; the disc 4 and 15."""
    assert [int(diffeo.mode_mask(c).sum()) for c in (3, 5)] == [6, 19]
    assert [int(diffeo.mode_mask(c, "disc").sum()) for c in (3, 5)] == [4, 15]
    coefficients = diffeo.sample_fields(4, 3, torch.Generator().manual_seed(0))
    assert torch.equal(coefficients[0, 0] != 0, diffeo.mode_mask(3))


@pytest.mark.parametrize("modes", diffeo.MODE_SETS)
def test_mean_squared_displacement_matches_its_closed_form(modes):
    """Pixel-averaged E|tau|^2 of 4,000 fields against (W^2 + H^2) T (H-1)(W-1) / (4HW) sum_{M_c} 1/(i^2+j^2)
    (0.660 px^2 published, 0.552 disc at delta = 1, c = 3 on 28x28), and the centre value against its sum."""
    size, cut = (28, 28), 3
    T = diffeo.temperature(1.0, cut, size)
    generator = torch.Generator().manual_seed(7)
    fields = diffeo.displacement_field(diffeo.sample_fields(4000, cut, generator, modes), T, size).double()
    closed = diffeo.mean_squared_displacement(T, cut, size, modes)
    assert closed == pytest.approx({"published": 0.660, "disc": 0.552}[modes], abs=1e-3)
    assert fields.pow(2).sum(1).mean().item() == pytest.approx(closed, rel=0.03)
    center = fields[:, :, 13:15, 13:15].mean((-1, -2))  # the continuous centre lies between pixels 13 and 14
    assert center.pow(2).sum(1).mean().sqrt().item() == pytest.approx(
        diffeo.center_displacement(T, cut, size, modes), rel=0.06
    )
