"""Study intervals against closed forms: the t-interval of a mean and of a geometric mean, the Wilson
interval of an accuracy, the Welch interval of a ratio of geometric means, and the study's contrasts."""

import math

import pytest

from convbias.studies.intervals import cell, interval, ratio_interval, wilson


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


def test_ratio_of_geometric_means_has_the_welch_interval():
    """logs a: 0, 1, 2 (variance 1); b: 0, 0, 0, 2 (variance 1): difference 0.5, Welch df = 4.69."""
    from scipy.stats import t

    a, b = [1.0, math.e, math.e**2], [1.0, 1.0, 1.0, math.e**2]
    va, vb = 1 / 3, 1 / 4
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    half = t.ppf(0.975, df) * math.sqrt(va + vb)
    assert ratio_interval(a, b) == pytest.approx((math.exp(0.5), math.exp(0.5 - half), math.exp(0.5 + half)))
    assert math.isnan(ratio_interval([2.0], b)[1])


def test_contrasts_pair_runs_and_compare_groups():
    from convbias.studies.stability.study import contrasts

    def row(group, seed, checkpoint, r):
        return dict(group=f"{group} f=1", run=f"{group}{seed}", checkpoint=checkpoint, R=r, delta=1.0, cut=3)

    rows = [row("vanilla_cnn", s, c, r) for s in range(2) for c, r in (("init", 1.0 + s), ("best", 4.0 * (1 + s)))]
    rows += [row("fcn", s, c, r) for s in range(3) for c, r in (("init", 1.0), ("best", [8.0, 16.0, 32.0][s]))]
    for r in rows:
        r["train_fraction"] = 1.0
    out = {c["group"]: c for c in contrasts(rows, 1.0, 3, "init", "best", "vanilla_cnn")}
    cnn, fcn = out["vanilla_cnn f=1"], out["fcn f=1"]
    assert cnn["trained_over_init"] == pytest.approx(4.0) and cnn["trained_over_init_low"] == pytest.approx(4.0)
    expected = ratio_interval([8.0, 16.0, 32.0], [4.0, 8.0])
    assert (fcn["over_reference"], fcn["over_reference_low"], fcn["over_reference_high"]) == pytest.approx(expected)
    assert fcn["n"] == 3 and fcn["n_reference"] == 2 and fcn["reference"] == "vanilla_cnn f=1"
