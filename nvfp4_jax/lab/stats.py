"""The few statistics a study needs, in plain Python (no scipy): mean, standard deviation,
Welch's and the paired t-test with two-sided p-values from Student's t distribution."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


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
