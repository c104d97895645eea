"""Confidence intervals of study summaries over seeds: the mean (or geometric mean) with its 95% Student-t
interval, and a cell renderer that always shows n and the interval."""

from __future__ import annotations

import math

import torch

CONFIDENCE = 0.95


def t_quantile(df: int) -> float:
    """The two-sided 95% Student-t quantile with `df` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.5 + CONFIDENCE / 2, df))


def interval(values: list[float], log: bool = False) -> tuple[int, float, float, float]:
    """(n, centre, low, high): the mean with its 95% t-interval, or with `log` the geometric mean and the
    interval exp(mean log +/- t s / sqrt(n)). Non-finite (with `log`, non-positive) values are left out;
    the bounds are NaN when n < 2."""
    kept = [float(v) for v in values if math.isfinite(float(v)) and (float(v) > 0 or not log)]
    n = len(kept)
    if n == 0:
        return 0, float("nan"), float("nan"), float("nan")
    x = torch.tensor([math.log(v) if log else v for v in kept], dtype=torch.float64)
    centre = float(x.mean())
    half = t_quantile(n - 1) * float(x.std()) / math.sqrt(n) if n > 1 else float("nan")
    bounds = (centre, centre - half, centre + half)
    return (n, *(math.exp(v) for v in bounds)) if log else (n, *bounds)


def cell(centre: float, low: float, high: float, digits: str = ".3g") -> str:
    """'centre [low, high]', or 'centre (n = 1, no interval)'; 'undefined' for NaN."""
    if centre != centre:
        return "undefined"
    return f"{centre:{digits}} [{low:{digits}}, {high:{digits}}]" if low == low else f"{centre:{digits}} (no interval)"


def wilson(accuracy_percent: float, count: int) -> tuple[float, float]:
    """The 95% Wilson score interval (percent) of an accuracy measured on `count` test images: the test-set
    sampling uncertainty of one network, which says nothing of the spread between seeds."""
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + CONFIDENCE / 2))
    p = accuracy_percent / 100
    centre = (p + z * z / (2 * count)) / (1 + z * z / count)
    half = z / (1 + z * z / count) * math.sqrt(p * (1 - p) / count + z * z / (4 * count * count))
    return 100 * (centre - half), 100 * (centre + half)


def ratio_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(ratio, low, high): the ratio of the geometric means of two independent samples of positive values,
    with the 95% Welch interval on the difference of their mean logs (NaN with fewer than 2 values a side)."""
    la = torch.tensor([math.log(v) for v in a if math.isfinite(v) and v > 0], dtype=torch.float64)
    lb = torch.tensor([math.log(v) for v in b if math.isfinite(v) and v > 0], dtype=torch.float64)
    if len(la) < 2 or len(lb) < 2:
        nan = float("nan")
        return (math.exp(float(la.mean() - lb.mean())) if len(la) and len(lb) else nan), nan, nan
    va, vb = float(la.var()) / len(la), float(lb.var()) / len(lb)
    df = (va + vb) ** 2 / (va**2 / (len(la) - 1) + vb**2 / (len(lb) - 1)) if va + vb > 0 else len(la) + len(lb) - 2
    diff, half = float(la.mean() - lb.mean()), t_quantile(df) * math.sqrt(va + vb)
    return math.exp(diff), math.exp(diff - half), math.exp(diff + half)
