"""The statistics a study needs, without scipy: mean, standard deviation, Welch's and the paired
t-test (two-sided p-values from Student's t), t and bootstrap confidence intervals, Holm's
correction, the sign test and the TOST equivalence test."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def std(xs: Sequence[float]) -> float | None:
    """Sample standard deviation (n - 1); None for fewer than two values."""
    if len(xs) < 2:
        return None
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    # The continued fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry
    # I_x(a, b) = 1 - I_{1-x}(b, a) beyond it.
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` (possibly fractional) degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


@dataclass(frozen=True)
class TTest:
    """A t statistic, its degrees of freedom and two-sided p-value (None when undefined)."""

    t: float | None
    df: float | None
    p: float | None


_UNDEFINED = TTest(None, None, None)


def welch(a: Sequence[float], b: Sequence[float]) -> TTest:
    """Welch's unequal-variance t-test of mean(a) - mean(b), Welch-Satterthwaite df."""
    if len(a) < 2 or len(b) < 2:
        return _UNDEFINED
    va, vb = std(a) ** 2 / len(a), std(b) ** 2 / len(b)
    diff = mean(a) - mean(b)
    if va + vb == 0.0:
        return TTest(math.copysign(math.inf, diff), None, 0.0) if diff else _UNDEFINED
    t = diff / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return TTest(t, df, t_two_sided_p(t, df))


def paired(a: Sequence[float], b: Sequence[float]) -> TTest:
    """The paired t-test of the per-pair differences a[i] - b[i] (same seed: same init and data)."""
    if len(a) != len(b):
        raise ValueError(f"paired t-test needs equal lengths, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    if len(d) < 2:
        return _UNDEFINED
    sd = std(d)
    if sd == 0.0:
        return TTest(math.copysign(math.inf, mean(d)), len(d) - 1, 0.0) if mean(d) else _UNDEFINED
    t = mean(d) / (sd / math.sqrt(len(d)))
    return TTest(t, len(d) - 1, t_two_sided_p(t, len(d) - 1))


# --- intervals, multiple comparisons, equivalence ---------------------------------------------


def t_quantile(q: float, df: float) -> float:
    """The `q` quantile of Student's t with `df` degrees of freedom (0 < q < 1), by bisection
    on the two-sided tail, which is monotone in |t|."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile {q} must lie in (0, 1)")
    if q == 0.5:
        return 0.0
    tail = 2.0 * min(q, 1.0 - q)  # P(|T| >= t*) for the t* we want
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > tail:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_two_sided_p(mid, df) > tail:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-13 * max(1.0, hi):
            break
    t = 0.5 * (lo + hi)
    return t if q > 0.5 else -t


def t_interval(d: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """The t confidence interval of the mean of `d` (per-seed differences); None below 2 values."""
    if len(d) < 2:
        return None
    m, s = mean(d), std(d)
    half = t_quantile(0.5 + level / 2.0, len(d) - 1) * s / math.sqrt(len(d))
    return (m - half, m + half)


def bootstrap_interval(d: Sequence[float], level: float = 0.95, *, resamples: int = 10_000,
                       seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of `d`, resampling seeds with replacement.

    With 3-5 seeds it is narrower than the t interval (it cannot see tails it has not sampled);
    both are reported so that a reader sees how much the choice matters. A fixed generator seed
    makes it a pure function of `d`."""
    if len(d) < 2:
        return None
    x = np.asarray(d, np.float64)
    idx = np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))
    means = x[idx].mean(axis=1)
    lo, hi = np.quantile(means, [0.5 - level / 2.0, 0.5 + level / 2.0])
    return (float(lo), float(hi))


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm-Bonferroni adjusted p-values (step-down, monotone, capped at 1); None stays None and
    does not count as a test."""
    present = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m = len(present)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(present):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def sign_test(d: Sequence[float]) -> float | None:
    """Exact two-sided sign test of `d` against 0 (ties dropped): how likely as many same-sign
    differences are under a fair coin. Three of three is p = 0.25."""
    pos, neg = sum(x > 0 for x in d), sum(x < 0 for x in d)
    n = pos + neg
    if n == 0:
        return None
    k = min(pos, neg)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


@dataclass(frozen=True)
class Equivalence:
    """TOST: the mean difference lies within (-margin, +margin) when p (the larger of the two
    one-sided p-values) is below alpha."""

    margin: float
    p_lower: float | None
    p_upper: float | None
    p: float | None


def tost(d: Sequence[float], margin: float) -> Equivalence:
    """Two one-sided t-tests of the per-seed differences `d` against -margin and +margin."""
    if margin <= 0:
        raise ValueError(f"margin={margin}: must be > 0")
    if len(d) < 2:
        return Equivalence(margin, None, None, None)
    m, se, df = mean(d), std(d) / math.sqrt(len(d)), len(d) - 1
    if se == 0.0:
        inside = -margin < m < margin
        return Equivalence(margin, 0.0 if inside else 1.0, 0.0 if inside else 1.0, 0.0 if inside else 1.0)

    def upper_tail(t: float) -> float:  # P(T >= t)
        half = 0.5 * t_two_sided_p(t, df)
        return half if t >= 0 else 1.0 - half

    p_lower = upper_tail((m + margin) / se)  # H0: mean <= -margin
    p_upper = upper_tail((margin - m) / se)  # H0: mean >= +margin
    return Equivalence(margin, p_lower, p_upper, max(p_lower, p_upper))
