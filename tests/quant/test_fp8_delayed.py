"""FP8 delayed scaling: TE's amax-history update, and its state carried by the custom VJP.

The reference below restates TE's `DelayedScaleQuantizer.update` (facts from TE's JAX code):
write the step's amax into slot 0, scale = fp8_max / max(history) / 2**margin unless that
amax is 0 or not finite, then roll left by one and zero slot 0.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close_to_sum, einsum_with_terms, sum_error_bound, violations

from nvfp4_jax.quant import dequantize_fp8, quantize_fp8
from nvfp4_jax.quant.dot import make_dot_general
from nvfp4_jax.quant.fp8_delayed import (
    init_fp8_meta,
    scale_from_amax,
    update_role,
)
from nvfp4_jax.quant.recipe import get_recipe

# Every test runs under IEEE and under GPU-legal float32 arithmetic (tests/quant/conftest.py).
pytestmark = pytest.mark.usefixtures("arithmetic")

FP8_MAX = {"e4m3": np.float32(448.0), "e5m2": np.float32(57344.0)}
DIMS = (((1,), (0,)), ((), ()))


def _te_update(history, scale, amax, fmt, margin=0):
    """TE's delayed-scaling update, in numpy float32."""
    h = np.array(history, np.float32)
    h[0] = amax
    a = np.float32(h.max()) if not np.isnan(h).any() else np.float32(np.nan)
    if a > 0 and np.isfinite(a):
        scale = np.float32(FP8_MAX[fmt] / a) / np.float32(2.0**margin)
    h = np.roll(h, -1)
    h[0] = 0.0
    return h, np.float32(scale)


@pytest.mark.parametrize("fmt, margin", [("e4m3", 0), ("e5m2", 0), ("e4m3", 2)])
def test_update_rule_matches_te(fmt, margin):
    """Six steps through a history of length 4: the oldest amax falls out; a zero or NaN amax
    keeps the previous scale."""
    amaxes = [3.0, 0.5, 7.0, 0.0, 0.25, 1.5, np.nan, 2.0]
    h, s = jnp.zeros((4,), jnp.float32), jnp.ones((1,), jnp.float32)
    h_ref, s_ref = np.zeros(4, np.float32), np.float32(1.0)
    step = jax.jit(update_role, static_argnums=(3,), static_argnames=("margin",))
    for amax in amaxes:
        h, s = step(h, s, jnp.float32(amax), fmt, margin=margin)
        h_ref, s_ref = _te_update(h_ref, s_ref, amax, fmt, margin)
        np.testing.assert_array_equal(np.asarray(h), h_ref)
        np.testing.assert_array_equal(np.asarray(s), [s_ref])


def test_history_rolls_newest_last():
    h = jnp.asarray([0.0, 1.0, 2.0, 3.0], jnp.float32)  # slot 0 is the free slot
    nh, ns = update_role(h, jnp.ones((1,)), jnp.float32(9.0), "e4m3")
    np.testing.assert_array_equal(np.asarray(nh), [0.0, 2.0, 3.0, 9.0])
    assert float(ns[0]) == np.float32(448.0) / np.float32(9.0)


def test_scale_from_amax_guards():
    np.testing.assert_array_equal(np.asarray(scale_from_amax(0.0, "e4m3")), [1.0])
    np.testing.assert_array_equal(np.asarray(scale_from_amax(np.inf, "e5m2", fallback=jnp.full((1,), 3.0))), [3.0])
    np.testing.assert_array_equal(np.asarray(scale_from_amax(2.0, "e5m2", margin=1)), [57344.0 / 2 / 2])


def _recipe(length=8):
    return dataclasses.replace(get_recipe("te_fp8_delayedscaling"), amax_history_len=length)


def _ref_gemm(x, w, sx, sw):
    """(the float64 product of the dequantized operands, its sum|terms|)."""
    qx = np.asarray(_deq(x, np.float32(sx), "e4m3"), np.float64)
    qw = np.asarray(_deq(w, np.float32(sw), "e4m3"), np.float64)
    return einsum_with_terms("tk,kn->tn", qx, qw)


# The FP8 GEMM sums exact E4M3 products in fp32 (K terms) and multiplies by the decode scales'
# product (2 roundings); each reference operand is data * scale_inv rounded once: gamma(K + 3)
# of sum|terms| (tests/tolerance.py). No division enters, so the arithmetic fixture's faithful
# division does not widen it.
GEMM_ROUNDINGS = 3


def test_scale_at_step_t_uses_only_earlier_amaxes():
    """Step 1 quantizes with the initial unit scale even though X's amax is 1000 (E4M3
    saturates at 448); step 2 with the scale from step 1's amax, not from its own X."""
    r = _recipe()
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    x1 = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32).at[0, 0].set(1000.0)
    x2 = jnp.asarray(rng.normal(size=(8, 32)) * 0.01, jnp.float32)

    @jax.jit
    def step(meta, x):
        y, vjp = jax.vjp(lambda m: make_dot_general(r, fp8_meta=m)(x, w, DIMS), meta)
        return y, vjp(jnp.ones_like(y))[0]

    meta0 = init_fp8_meta(r.amax_history_len)
    y1, meta1 = step(meta0, x1)
    assert_close_to_sum(y1, *_ref_gemm(x1, w, 1.0, 1.0), n=32, extra_roundings=GEMM_ROUNDINGS)
    sx1 = np.float32(448.0) / np.float32(1000.0)
    # Current scaling (X's own amax) would not have saturated: row 0 would differ by ~552 * W.
    current, _ = _ref_gemm(x1, w, sx1, 1.0)
    assert np.abs(np.asarray(y1)[0] - current[0]).max() > 100.0
    assert float(meta1["x_scale"][0]) == sx1

    y2, _ = step(meta1, x2)
    sw1 = float(meta1["w_scale"][0])
    assert_close_to_sum(y2, *_ref_gemm(x2, w, sx1, sw1), n=32, extra_roundings=GEMM_ROUNDINGS)
    own = np.float32(448.0) / np.float32(np.abs(np.asarray(x2)).max())
    # X's own (current) scale would give another product: outside that product's bound.
    wrong, wrong_terms = _ref_gemm(x2, w, own, sw1)
    assert (violations(y2, wrong, sum_error_bound(wrong_terms, 32, GEMM_ROUNDINGS)) > 1).any()


def test_jitted_two_step_run_updates_state_as_te():
    """Two SGD steps of a linear layer, jitted: the state after each step is TE's update of
    the amaxes of X, W and dY (all computed here independently), and dY is quantized with the
    E5M2 scale carried from the step before."""
    r = _recipe(length=4)
    rng = np.random.default_rng(1)
    xs = [jnp.asarray(rng.normal(size=(16, 32)) * s, jnp.float32) for s in (1.0, 3.0)]
    cs = [jnp.asarray(rng.normal(size=(16, 16)) * s, jnp.float32) for s in (0.5, 2.0)]
    w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)

    def loss(w, meta, x, c):
        return jnp.sum(make_dot_general(r, fp8_meta=meta)(x, w, DIMS) * c)  # dL/dY = c

    @jax.jit
    def train_step(w, meta, x, c):
        dw, new_meta = jax.grad(loss, argnums=(0, 1))(w, meta, x, c)
        return w - 0.01 * dw, new_meta, dw

    meta = init_fp8_meta(4)
    ref = {k: np.asarray(v) for k, v in meta.items()}
    for x, c in zip(xs, cs):
        used = {role: np.float32(ref[f"{role}_scale"][0]) for role in ("x", "w", "dy")}
        w_before = w
        w, meta, dw = train_step(w, meta, x, c)
        amaxes = {
            "x": np.abs(np.asarray(x)).max(),
            "w": np.abs(np.asarray(w_before)).max(),
            "dy": np.abs(np.asarray(c)).max(),
        }
        for role, fmt in (("x", "e4m3"), ("w", "e4m3"), ("dy", "e5m2")):
            h, s = _te_update(ref[f"{role}_amax_history"], ref[f"{role}_scale"][0], amaxes[role], fmt)
            ref[f"{role}_amax_history"], ref[f"{role}_scale"] = h, np.asarray([s], np.float32)
        for k in ref:
            np.testing.assert_array_equal(np.asarray(meta[k]), ref[k], err_msg=k)
        # WGRAD = X^T . dY, each quantized with the scale carried into this step.
        qx = np.asarray(_deq(x, used["x"], "e4m3"), np.float64)
        qg = np.asarray(_deq(c, used["dy"], "e5m2"), np.float64)
        want, terms = einsum_with_terms("tk,tn->kn", qx, qg)
        assert_close_to_sum(dw, want, terms, n=16, extra_roundings=GEMM_ROUNDINGS)  # 16 tokens
    assert (ref["dy_scale"] != 1.0).all() and ref["x_amax_history"][-2:].tolist() == [
        np.float32(np.abs(np.asarray(xs[0])).max()), np.float32(np.abs(np.asarray(xs[1])).max())
    ]


@functools.partial(jax.jit, static_argnums=2)
def _deq(a, scale, fmt):
    return dequantize_fp8(quantize_fp8(a, scale, fmt))
