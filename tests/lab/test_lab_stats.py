"""The lab's intervals, multiple-comparison correction and equivalence test against scipy on
fixed inputs (scipy is a test dependency only; the lab computes these with numpy)."""

import math

import numpy as np
import pytest

from nvfp4_jax.lab import stats

scipy_stats = pytest.importorskip("scipy.stats")

# Per-seed differences of the size a study sees (nats).
D5 = [0.0123, 0.0071, -0.0034, 0.0188, 0.0049]
D3 = [0.0110, 0.0142, 0.0009]


@pytest.mark.parametrize("q,df", [(0.975, 2), (0.975, 4), (0.95, 7.5), (0.025, 3), (0.6, 1), (0.999, 30)])
def test_t_quantile_matches_scipy(q, df):
    assert stats.t_quantile(q, df) == pytest.approx(scipy_stats.t.ppf(q, df), rel=1e-9)


@pytest.mark.parametrize("d", [D5, D3])
def test_t_interval_matches_scipy(d):
    lo, hi = stats.t_interval(d)
    want = scipy_stats.t.interval(0.95, len(d) - 1, loc=np.mean(d), scale=scipy_stats.sem(d))
    assert (lo, hi) == pytest.approx(want, rel=1e-9)
    assert stats.t_interval([0.1]) is None


def test_bootstrap_interval_agrees_with_scipy_within_resampling_noise():
    lo, hi = stats.bootstrap_interval(D5, resamples=20_000)
    res = scipy_stats.bootstrap((np.asarray(D5),), np.mean, confidence_level=0.95, n_resamples=20_000,
                                method="percentile", random_state=1)
    ci = res.confidence_interval
    # Two independent resamplings: their percentiles agree to a small fraction of the width.
    width = hi - lo
    assert abs(lo - ci.low) < 0.05 * width and abs(hi - ci.high) < 0.05 * width
    # Pure: the same input gives the same interval; the interval holds the mean and lies
    # within the data's range (a percentile bootstrap cannot leave it).
    assert stats.bootstrap_interval(D5, resamples=20_000) == (lo, hi)
    assert min(D5) <= lo < np.mean(D5) < hi <= max(D5)


def _holm_reference(p):
    # Textbook definition: adjusted p_(i) = max_{j<=i} min(1, (m - j + 1) p_(j)).
    order = np.argsort(p)
    m = len(p)
    adj = np.empty(m)
    best = 0.0
    for rank, i in enumerate(order):
        best = max(best, min(1.0, (m - rank) * p[i]))
        adj[i] = best
    return adj


def test_holm_matches_the_definition_and_bonferroni_bounds():
    p = [0.01, 0.04, 0.03, 0.005, 0.2, 0.6, 0.049]
    got = stats.holm(p)
    assert got == pytest.approx(list(_holm_reference(np.asarray(p))), rel=1e-12)
    # Hand values: the smallest is multiplied by m = 7, the largest is never below its raw p.
    assert got[3] == pytest.approx(0.035)
    assert all(a >= b for a, b in zip(got, p)) and max(got) <= 1.0
    # None is not a test: the others are corrected over the remaining count.
    assert stats.holm([0.02, None, 0.01]) == [pytest.approx(0.02), None, pytest.approx(0.02)]


def test_holm_agrees_with_scipy_where_it_can_be_derived():
    # Holm over two tests equals min(1, 2 p_min) for the smaller and max of that and p_max.
    a, b = scipy_stats.ttest_1samp(D5, 0.0).pvalue, scipy_stats.ttest_1samp(D3, 0.0).pvalue
    got = stats.holm([a, b])
    assert min(got) == pytest.approx(min(1.0, 2 * min(a, b)))
    assert max(got) == pytest.approx(max(min(1.0, 2 * min(a, b)), max(a, b)))


@pytest.mark.parametrize("d", [[1, 1, 1], [1, -1, 1, 1, 1], [0.2, 0.1, -0.3, 0.0, 0.4, 0.5, 0.6], [-1] * 5])
def test_sign_test_matches_scipy_binomtest(d):
    pos, neg = sum(x > 0 for x in d), sum(x < 0 for x in d)
    want = scipy_stats.binomtest(pos, pos + neg, 0.5).pvalue
    assert stats.sign_test(d) == pytest.approx(want, rel=1e-12)
    assert stats.sign_test([1.0, 2.0, 3.0]) == pytest.approx(0.25)


@pytest.mark.parametrize("d,margin", [(D5, 0.02), (D5, 0.01), (D3, 0.02), ([0.001, -0.002, 0.0005, 0.0015], 0.005)])
def test_tost_matches_two_one_sided_scipy_t_tests(d, margin):
    eq = stats.tost(d, margin)
    lower = scipy_stats.ttest_1samp(d, -margin, alternative="greater").pvalue
    upper = scipy_stats.ttest_1samp(d, margin, alternative="less").pvalue
    assert eq.p_lower == pytest.approx(lower, rel=1e-9)
    assert eq.p_upper == pytest.approx(upper, rel=1e-9)
    assert eq.p == pytest.approx(max(lower, upper), rel=1e-9)


def test_tost_equivalence_needs_the_interval_inside_the_margin():
    # TOST at alpha is the 1 - 2 alpha (90%) t interval lying inside (-margin, margin).
    lo, hi = stats.t_interval(D5, level=0.90)
    inside = stats.tost(D5, max(abs(lo), abs(hi)) * 1.001)
    outside = stats.tost(D5, max(abs(lo), abs(hi)) * 0.999)
    assert inside.p < 0.05 < outside.p
    with pytest.raises(ValueError):
        stats.tost(D5, 0.0)
