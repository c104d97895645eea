"""Study intervals against closed forms: the t-interval of a mean and of a geometric mean, the Wilson
interval of an accuracy."""

import math

import pytest

from convbias.experiments.intervals import cell, interval, wilson


def test_t_interval_of_mean_and_geometric_mean():
    n, centre, low, high = interval([1.0, 2.0, 4.0, float("nan")])
    half = 4.302653 * math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2) / math.sqrt(3)
    assert (n, centre, low, high) == pytest.approx((3, 7 / 3, 7 / 3 - half, 7 / 3 + half), rel=1e-6)
    n, centre, low, high = interval([1.0, 2.0, 4.0], log=True)
    half = 4.302653 * math.log(2) / math.sqrt(3)  # log values 0, ln 2, 2 ln 2: standard deviation ln 2
    assert (centre, low, high) == pytest.approx((2.0, 2 * math.exp(-half), 2 * math.exp(half)), rel=1e-6)
    assert interval([5.0])[2] != interval([5.0])[2]  # one value: no interval
    assert cell(2.0, 1.0, 3.0) == "2 [1, 3]" and cell(2.0, float("nan"), float("nan")) == "2 (no interval)"


def test_wilson_interval_of_an_accuracy():
    """96% on 360 images: centre (p + z^2/2n) / (1 + z^2/n), z = 1.959964."""
    z, p, n = 1.959964, 0.96, 360
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert wilson(96.0, 360) == pytest.approx((100 * (centre - half), 100 * (centre + half)), rel=1e-6)
