"""A-priori float32 rounding-error bounds: the tolerances of the tests' float comparisons.

A float32 result compared with a float64 formula (or with another float32 evaluation) differs
from it by rounding only, and how much rounding can do is known before the run: a tolerance
taken from these bounds passes on every machine, whatever order XLA:CPU's threads, a GPU or a
mesh add the terms in, and stays small enough that a wrong implementation (a missing scale, a
transposed operand, a bf16 intermediate) fails it. A tolerance that "happened to pass" at
rtol=1e-5 does neither: the relative error of an element where the terms cancel is unbounded.

The standard results (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 2.2,
3.1, 4.2), with u the unit roundoff (2**-24 for float32: a correctly rounded operation errs by
at most u relative) and gamma(n) = n u / (1 - n u):

* a sum of n terms computed in floating point in any order (recursive, pairwise, blocked,
  split over threads or devices and the parts added) errs by at most gamma(n - 1) * sum|terms|;
* a dot product of length n (each product rounded, then summed in any order) errs by at most
  gamma(n) * sum|x_i y_i|; an FMA only removes roundings, so the bound holds with one;
* every further rounding each term went through, on either side of the comparison (an input
  rounded to float32, a product of two rounded factors, a per-tensor decode scale applied to
  the sum, a float64 reference built from rounded operands), adds one: gamma(n + k);
* a result rounded once more to a narrower type (bf16: u = 2**-8) adds u_out * |result|
  (divided by 1 - u_out, as |result| is the rounded value);
* two float32 evaluations of the same sum (two kernels, two meshes) differ by at most twice
  the bound of one (`sides=2`).

`abs_terms` is sum|terms| computed in float64 from the same operands (`einsum_with_terms`).
Computing it from rounded operands changes it by O(u) relative, an O(n u^2) change to the bound
that gamma's 1 / (1 - n u) already covers; the float64 reference's own error (gamma(n) with
u = 2**-53) and underflow (each rounding in the subnormal range errs by up to 2**-150
absolute, not relative) are added explicitly. No bound is fitted to a test's outcome.

Other operations, counted in units of u where a bound needs them:

* DIVISION_ROUNDINGS: XLA:GPU's float32 division (and `backend_arithmetic.faithful_division`,
  which the `arithmetic` fixture applies) may be 2 ulp off the correctly rounded quotient:
  2.5 ulp <= 5 u.
* TRANSCENDENTAL_ROUNDINGS: XLA:CPU's float32 exp, log and rsqrt (jax 0.10.2) err by at most
  2.7 u relative over 2M random arguments each (exp on [-87, 1], log on [1e-3, 1e3], rsqrt on
  [1e-3, 1e3]), sin and cos by at most 0.55 u absolute on [-2000, 2000]; 4 u is assumed. This
  is the one measured constant; it is a property of the pinned XLA's polynomial
  approximations, not of the machine, the thread count or the load.

Quantities that are not one sum (softmax attention, below) get first-order bounds built from
these rules stage by stage; the second-order terms are O((n u)^2) relative, below 1e-8 at the
tests' sizes, and `FIRST_ORDER_SLACK` covers them.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

U = 2.0**-24  # float32 unit roundoff
U64 = 2.0**-53
_SUBNORMAL_ROUNDING = 2.0**-150  # the largest absolute error of one float32 rounding below 2**-126
DIVISION_ROUNDINGS = 5
TRANSCENDENTAL_ROUNDINGS = 4
FIRST_ORDER_SLACK = 1.01

__all__ = [
    "U", "DIVISION_ROUNDINGS", "TRANSCENDENTAL_ROUNDINGS", "gamma", "unit_roundoff",
    "einsum_with_terms", "sum_error_bound", "assert_within", "assert_close_to_sum", "violations",
    "error_statistic_rtol", "attention_error_bounds", "bf16_rounded",
]


def unit_roundoff(dtype) -> float:
    """u of a float dtype: 2**-p for a p-bit significand (float32 2**-24, bfloat16 2**-8)."""
    return float(2.0 ** -(ml_dtypes.finfo(np.dtype(dtype)).nmant + 1))


def gamma(n, u: float = U):
    """n u / (1 - n u): the relative error bound of n chained roundings (n may be an array)."""
    nu = np.asarray(n, np.float64) * u
    if np.any(nu >= 1):
        raise ValueError(f"gamma({n}) with u={u}: n u >= 1, no bound")
    return nu / (1 - nu)


def einsum_with_terms(subscripts: str, *operands):
    """(the einsum, the einsum of the operands' absolute values), both in float64: the exact
    value of a dot product of the given (already rounded) operands and its sum|terms|."""
    ops = [np.asarray(o, np.float64) for o in operands]
    return np.einsum(subscripts, *ops), np.einsum(subscripts, *(np.abs(o) for o in ops))


def sum_error_bound(abs_terms, n, extra_roundings=0, *, sides=1, out_dtype=None, want=None):
    """Elementwise bound on |got - want| for a float32 sum / dot product of length `n`.

    abs_terms: sum|terms| per element (float64). extra_roundings: roundings each term went
    through besides the dot product's own (input roundings, decode scales, the reference's
    rounded operands). sides=2: `want` is itself one float32 evaluation of the same sum.
    out_dtype: the result was rounded once more to this (narrower) dtype; `want` (the other
    side's value, or the exact one) is then needed for the u_out * |result| term.
    """
    abs_terms = np.asarray(abs_terms, np.float64)
    roundings = np.asarray(n, np.float64) + extra_roundings
    bound = sides * (gamma(roundings) * abs_terms + roundings * _SUBNORMAL_ROUNDING)
    if out_dtype is not None and unit_roundoff(out_dtype) > U:
        if want is None:
            raise ValueError("sum_error_bound: out_dtype needs `want` for the final rounding's size")
        # A rounded value r = fl(y) = y / (1 + d), |d| <= u_out, so |r - y| <= u_out |r|. With
        # got = fl(y): |got - want| <= u |got| + bound (+ u |want| when want = fl(y') too, sides=2),
        # and |got| <= |want| + |got - want|:
        u_out = unit_roundoff(out_dtype)
        bound = (bound + sides * u_out * np.abs(np.asarray(want, np.float64))) / (1 - u_out)
    return bound + gamma(n, U64) * abs_terms


def violations(got, want, bound) -> np.ndarray:
    """|got - want| / bound, elementwise (> 1: outside the bound; inf where the bound is 0)."""
    got, want = (np.asarray(a, np.float64) for a in (got, want))
    bound = np.broadcast_to(np.asarray(bound, np.float64), np.broadcast_shapes(got.shape, want.shape))
    err = np.abs(got - want)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(err == 0, 0.0, err / bound)


def assert_within(got, want, bound, what: str = ""):
    """Every |got - want| <= bound (elementwise, float64; NaN fails). The message names the
    worst element and by how much it exceeds its bound."""
    got_, want_ = (np.asarray(a, np.float64) for a in (got, want))
    assert got_.shape == want_.shape or got_.size == 1 or want_.size == 1, (what, got_.shape, want_.shape)
    ratio = violations(got_, want_, bound)
    if os.environ.get("TOLERANCE_REPORT"):  # how much of its bound a comparison uses
        print(f"tolerance: {what or 'comparison'}: max |diff| / bound = {np.nanmax(ratio, initial=0):.3g}")
    bad = ~(ratio <= 1)  # NaN counts as a violation
    if bad.any():
        worst = np.unravel_index(np.nanargmax(np.where(bad, np.nan_to_num(ratio, nan=np.inf), -1)), ratio.shape)
        g, w = np.broadcast_to(got_, ratio.shape)[worst], np.broadcast_to(want_, ratio.shape)[worst]
        b = np.broadcast_to(np.asarray(bound, np.float64), ratio.shape)[worst]
        raise AssertionError(
            f"{what + ': ' if what else ''}{int(bad.sum())} of {ratio.size} elements outside the "
            f"float32 rounding bound; worst at {tuple(int(i) for i in worst)}: got {g!r}, want {w!r}, "
            f"|diff| {abs(g - w):.3e} = {ratio[worst]:.3g} x bound {b:.3e}")


def assert_close_to_sum(got, want, abs_terms, n, extra_roundings=0, *, sides=1, out_dtype=None, what=""):
    """`got` is within the a-priori rounding bound of the sum `want` (see `sum_error_bound`)."""
    bound = sum_error_bound(abs_terms, n, extra_roundings, sides=sides, out_dtype=out_dtype, want=want)
    assert_within(got, want, bound, what)


def error_statistic_rtol(n) -> float:
    """Relative bound on the rounding error of `health.value_stats`' `error` statistic,
    ||q - x|| / ||x|| over n elements, computed in float32 from float32 x and q:

    each term of ||x||^2 is (x / amax)^2 (a division and a square), of ||q - x||^2 also the
    subtraction; each sum of n squares (positive terms, so its relative error is that of the
    terms: n - 1 additions); a square root each (halving the relative error, plus one
    rounding); the final division. First order: (n + 2 + 2 d) / 2 + 1 + (n + 2 d) / 2 + 1 + d
    = n + 3 + 3 d roundings, d = DIVISION_ROUNDINGS; one more for the square root's halving
    being a little over half. Against another float32 evaluation (another fusion of the same
    sums) the bound doubles.
    """
    return float(gamma(np.asarray(n) + 4 + 3 * DIVISION_ROUNDINGS))


# --- softmax attention ------------------------------------------------------------------------


def attention_error_bounds(q, k, v, dy=None, *, segment_ids=None, key_blocks=1):
    """First-order bounds on the rounding error of ONE float32 evaluation of causal GQA
    softmax attention (q [B, L, H, K], k and v [B, L, G, K], float32 operands and arithmetic),
    its output and, given the cotangent dy [B, L, H, K], dq, dk and dv.

    Returns {"out": (exact, bound), "dq": ..., "dk": ..., "dv": ...}, float64. Two kernels agree
    within the sum of their bounds. The bound holds for the kernels of this repository and
    JAX's XLA attention alike, each stage charged the larger rounding count among them:

    * scores s = q.k / sqrt(K): a K-term dot, the scale's rounding and its application (or q
      scaled first): gamma(K + 3) * |q|.|k| / sqrt(K) per score;
    * probabilities p = softmax(s), relative error theta per row: 2 max|ds| (a score's own
      error and the row's log-sum-exp's, which is 1-Lipschitz in the scores); the subtractions
      s - max (u |s - max| each, twice for the running maxima of an online softmax, once more
      for the backward's s - lse); exp, log and the multiply around each of the
      `key_blocks` online-softmax rescalings ((TRANSCENDENTAL_ROUNDINGS + 2) u per stage);
      the normaliser's sum (gamma(n), n = keys the row sees); the log-sum-exp's own rounding
      (u |lse|, u |max|) where the backward recomputes p from it;
    * out = p v: theta plus gamma(n + 1) on sum_j p |v|;
    * dv = p^T dy, dP = dy v^T, D = rowsum(p dP) = dy . out (the larger of the two routes),
      dS = p (dP - D) (3 u for the subtraction and products), dq = dS k / sqrt(K),
      dk = dS^T q / sqrt(K): each a sum bounded as above, its inputs' errors propagated.

    Sums over query heads sharing a key/value head (GQA) are sums of more terms: their n is
    counted. The result is multiplied by FIRST_ORDER_SLACK for the neglected O((n u)^2) terms.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, L, H, K = q.shape
    G = k.shape[2]
    R = H // G
    qg = q.reshape(B, L, G, R, K)
    scale = np.sqrt(K)
    s, s_abs = einsum_with_terms("blgrk,bmgk->bgrlm", qg, k)
    s, s_abs = s / scale, s_abs / scale
    mask = np.tril(np.ones((L, k.shape[1]), bool))[None, None, None]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        mask = mask & (seg[:, :, None] == seg[:, None, :])[:, None, None]
    mask = np.broadcast_to(mask, s.shape)
    n = mask.sum(-1)  # keys seen per row [B, G, R, L]; causal: never 0
    s_max = np.where(mask, s, -np.inf).max(-1)
    s_min = np.where(mask, s, np.inf).min(-1)
    e = np.where(mask, np.exp(np.where(mask, s, 0) - s_max[..., None]), 0.0)
    z = e.sum(-1)
    p = e / z[..., None]
    lse = s_max + np.log(z)
    ds = gamma(K + 3) * np.where(mask, s_abs, 0).max(-1)  # per row
    stage = (TRANSCENDENTAL_ROUNDINGS + 2) * U
    theta = (2 * ds + U * (3 * (s_max - s_min) + np.abs(s_max) + np.abs(lse))
             + stage * (key_blocks + 2 + np.log(n)) + gamma(n))  # [B, G, R, L]
    rows = lambda x: np.moveaxis(x, 3, 1)[..., None]  # [B, G, R, L] -> [B, L, G, R, 1]

    out, out_terms = einsum_with_terms("bgrlm,bmgk->blgrk", p, v)
    out_err = (rows(theta) + rows(gamma(n + 1))) * out_terms
    result = {"out": (out.reshape(B, L, H, K), out_err.reshape(B, L, H, K))}
    if dy is None:
        return {key: (x, FIRST_ORDER_SLACK * b) for key, (x, b) in result.items()}

    dyg = np.asarray(dy, np.float64).reshape(B, L, G, R, K)
    dp, dp_terms = einsum_with_terms("blgrk,bmgk->bgrlm", dyg, v)
    dp_err = gamma(K) * dp_terms
    d = (p * dp).sum(-1)
    d_err_softmax = (p * (theta[..., None] * np.abs(dp) + dp_err)).sum(-1) + gamma(n) * (p * np.abs(dp)).sum(-1)
    d_err_dot = (np.einsum("blgrk,blgrk->bgrl", np.abs(dyg), out_err)
                 + gamma(K) * np.einsum("blgrk,blgrk->bgrl", np.abs(dyg), np.abs(out)))
    d_err = np.maximum(d_err_softmax, d_err_dot)
    dsc = p * (dp - d[..., None])
    dsc_err = p * (theta[..., None] * np.abs(dp - d[..., None]) + dp_err + d_err[..., None]
                   + 3 * U * (np.abs(dp) + np.abs(d)[..., None]))
    dsc_err = np.where(mask, dsc_err, 0.0)
    n_keys = mask.sum(axis=(2, 3))  # query rows (x heads) each key meets [B, G, M]
    cols = lambda x: np.moveaxis(x, 2, 1)[..., None]  # [B, G, M] -> [B, M, G, 1]

    dq, dq_terms = einsum_with_terms("bgrlm,bmgk->blgrk", dsc, k)
    dq_err = np.einsum("bgrlm,bmgk->blgrk", dsc_err, np.abs(k)) + rows(gamma(n + 3)) * dq_terms
    dk, dk_terms = einsum_with_terms("bgrlm,blgrk->bmgk", dsc, qg)
    dk_err = np.einsum("bgrlm,blgrk->bmgk", dsc_err, np.abs(qg)) + cols(gamma(n_keys + 3)) * dk_terms
    dv, dv_terms = einsum_with_terms("bgrlm,blgrk->bmgk", p, dyg)
    dv_err = np.einsum("bgrlm,blgrk->bmgk", p * theta[..., None], np.abs(dyg)) + cols(gamma(n_keys + 1)) * dv_terms
    result.update(dq=(dq.reshape(B, L, H, K) / scale, dq_err.reshape(B, L, H, K) / scale),
                  dk=(dk / scale, dk_err / scale), dv=(dv, dv_err))
    return {key: (x, FIRST_ORDER_SLACK * b) for key, (x, b) in result.items()}


def bf16_rounded(x) -> np.ndarray:
    """x rounded to bfloat16 (nearest even), as float64: the operand a bf16 GEMM multiplies."""
    return np.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16), np.float64)
