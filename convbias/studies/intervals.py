"""Confidence intervals of study summaries: the mean (or geometric mean) over seeds with its 95% Student-t
interval, gaps between models paired by seed, Welch intervals of a change between two samples, and the
test-set sampling intervals of one network (Wilson, Clopper-Pearson); a cell renderer that always shows
n and the interval."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy import stats as scipy_stats

CONFIDENCE = 0.95  # of every interval in a report


def t_quantile(df: float, confidence: float = CONFIDENCE) -> float:
    """The two-sided Student-t quantile (95% by default) with `df` degrees of freedom."""
    return float(scipy_stats.t.ppf(0.5 + confidence / 2, df))


def interval(values: list[float], log: bool = False, confidence: float = CONFIDENCE) -> tuple[int, float, float, float]:
    """(n, centre, low, high): the mean with its t-interval (95% by default; a Bonferroni interval over k
    comparisons is confidence 1 - 0.05 / k), or with `log` the geometric mean and the interval
    exp(mean log +/- t s / sqrt(n)). Non-finite (with `log`, non-positive) values are left out; the bounds
    are NaN when n < 2."""
    kept = [float(v) for v in values if math.isfinite(float(v)) and (float(v) > 0 or not log)]
    n = len(kept)
    if n == 0:
        return 0, float("nan"), float("nan"), float("nan")
    x = torch.tensor([math.log(v) if log else v for v in kept], dtype=torch.float64)
    centre = float(x.mean())
    half = t_quantile(n - 1, confidence) * float(x.std()) / math.sqrt(n) if n > 1 else float("nan")
    bounds = (centre, centre - half, centre + half)
    return (n, *(math.exp(v) for v in bounds)) if log else (n, *bounds)


def cell(centre: float, low: float, high: float, digits: str = ".3g") -> str:
    """'centre [low, high]', or 'centre (n = 1, no interval)'; 'undefined' for NaN."""
    if centre != centre:
        return "undefined"
    return f"{centre:{digits}} [{low:{digits}}, {high:{digits}}]" if low == low else f"{centre:{digits}} (no interval)"


def error_bar(length: float) -> float:
    """An error bar's length for a plot: 0 where there is no interval (NaN: a single run)."""
    return 0.0 if math.isnan(length) else length


def wilson(accuracy_percent: float, count: int) -> tuple[float, float]:
    """The 95% Wilson score interval (percent) of an accuracy measured on `count` test images: the test-set
    sampling uncertainty of one network, which says nothing of the spread between seeds."""
    z = float(scipy_stats.norm.ppf(0.5 + CONFIDENCE / 2))
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


# -- runs over seeds: a metric's mean and spread, and gaps between models paired by seed ----------
def t_half_width(std: float, n: int, dof: float | None = None) -> float:
    """Half-width of the CONFIDENCE Student's t interval of a mean of n values with sample std `std`
    (nan for n < 2); `dof` overrides n - 1 (Welch)."""
    if n < 2:
        return math.nan
    return t_quantile(n - 1 if dof is None else dof) * std / math.sqrt(n)


ACCURACY_RANGE = (0.0, 100.0)  # percent: where an interval of an accuracy is cut
ACCURACY_NOTE = "intervals of accuracies are cut at 0 and 100%, where a t interval of few seeds runs past them"


def metric_bounds(metric: str) -> tuple[float, float]:
    """The values a study metric can take: an accuracy (a ``top1``/``top5`` column, in percent) lies in
    ACCURACY_RANGE; other metrics are unbounded."""
    return ACCURACY_RANGE if metric.endswith(("top1", "top5")) else (-math.inf, math.inf)


@dataclass(frozen=True)
class Stat:
    """Mean, sample std and count of one metric over seeds; str: mean ± std [95% interval of the mean], the
    interval cut at ``bounds`` (an accuracy's symmetric t interval can run past 100%)."""

    mean: float
    std: float
    n: int
    bounds: tuple[float, float] = (-math.inf, math.inf)

    @property
    def half_width(self) -> float:
        return t_half_width(self.std, self.n)

    @property
    def low(self) -> float:
        """The interval's lower end (NaN without an interval)."""
        return float(np.clip(self.mean - self.half_width, *self.bounds))

    @property
    def high(self) -> float:
        return float(np.clip(self.mean + self.half_width, *self.bounds))

    @property
    def cut(self) -> bool:
        """Whether a bound cut the interval."""
        return self.n > 1 and (self.low, self.high) != (self.mean - self.half_width, self.mean + self.half_width)

    def error_bars(self) -> tuple[float, float]:
        """The lengths of a plot's error bar below and above the mean (0 without an interval)."""
        return error_bar(self.mean - self.low), error_bar(self.high - self.mean)

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.mean:.1f} (no interval)"
        return f"{self.mean:.1f} ± {self.std:.1f} [{self.low:.1f}, {self.high:.1f}]"


@dataclass(frozen=True)
class Gap:
    """A difference in points with its interval: the mean of per-seed differences (paired), or a
    difference of two such means (Welch). str: +mean [low, high]."""

    mean: float
    half_width: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    @property
    def excludes_zero(self) -> bool:
        """The interval lies on one side of 0 (False without an interval)."""
        return not math.isnan(self.half_width) and (self.low > 0 or self.high < 0)

    def __str__(self) -> str:
        if math.isnan(self.half_width):
            return f"{self.mean:+.1f} (n = {self.n}: no interval)"
        return f"{self.mean:+.1f} [{self.low:+.1f}, {self.high:+.1f}]"


def stat(rows: list[dict[str, Any]], metric: str) -> Stat | None:
    values = [row[metric] for row in rows if metric in row]
    if not values:
        return None
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return Stat(float(np.mean(values)), std, len(values), metric_bounds(metric))


def paired_gap(rows: list[dict[str, Any]], base_rows: list[dict[str, Any]], metric: str) -> Gap | None:
    """Model minus baseline over the seeds both have (a seed fixes the init and the data subset): the
    mean of the per-seed differences and its t interval; None without a common seed."""
    return mean_gap(per_seed_gaps(rows, base_rows, metric))


def mean_gap(diffs: list[float]) -> Gap | None:
    if not diffs:
        return None
    std = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else 0.0
    return Gap(float(np.mean(diffs)), t_half_width(std, len(diffs)), len(diffs))


def gap_change(first: list[float], second: list[float]) -> Gap | None:
    """mean(second) - mean(first) of two independent samples (per-seed gaps at two fractions: different
    subsets), with Welch's t interval; None if either has fewer than 2 values."""
    if len(first) < 2 or len(second) < 2:
        return None
    v1, v2 = np.var(first, ddof=1) / len(first), np.var(second, ddof=1) / len(second)
    se = math.sqrt(v1 + v2)
    if se == 0:
        return Gap(float(np.mean(second) - np.mean(first)), 0.0, min(len(first), len(second)))
    dof = (v1 + v2) ** 2 / (v1**2 / (len(first) - 1) + v2**2 / (len(second) - 1))
    half = t_quantile(dof) * se
    return Gap(float(np.mean(second) - np.mean(first)), half, min(len(first), len(second)))


def per_seed_gaps(rows: list[dict[str, Any]], base_rows: list[dict[str, Any]], metric: str) -> list[float]:
    base = {row["seed"]: row[metric] for row in base_rows if metric in row and "seed" in row}
    return [row[metric] - base[row["seed"]] for row in rows if metric in row and row.get("seed") in base]


def proportion_interval(successes: int, total: int) -> tuple[float, float]:
    """Clopper-Pearson (exact) 95% interval of a proportion, in percent."""
    interval = scipy_stats.binomtest(int(successes), int(total)).proportion_ci(CONFIDENCE, method="exact")
    return 100 * interval.low, 100 * interval.high
