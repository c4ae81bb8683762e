"""The emulated GPU arithmetic (tests/backend_arithmetic.py) really perturbs what it claims to,
and catches a quantizer that divides: the bug it exists to find."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from backend_arithmetic import faithful_division, fma_contraction

from nvfp4_jax.nvfp4_spec import ref_quantize, tie_rich_data


def _ulps(got, want):
    return got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64)


def test_faithful_division_moves_about_half_the_quotients_by_at_most_two_ulp():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(20000) * 10).astype(np.float32)
    b = (rng.standard_normal(20000) * 10).astype(np.float32)
    exact = a / b
    with faithful_division():
        jitted = np.asarray(jax.jit(jnp.divide)(a, b))
        eager = np.asarray(jnp.asarray(a) / jnp.asarray(b))
        recip = np.asarray(jax.jit(jnp.reciprocal)(b))
        special = np.asarray(jax.jit(jnp.divide)(np.float32([0, 1, 1, np.inf, np.nan]),
                                                 np.float32([1, 0, np.inf, 1, 1])))
    for got, want in ((jitted, exact), (eager, exact), (recip, np.float32(1) / b)):
        off = _ulps(got, want)
        assert 0.3 < (off != 0).mean() < 0.7
        assert np.abs(off).max() == 2
    np.testing.assert_array_equal(special, np.float32([0, np.inf, 0, np.inf, np.nan]))
    # Leaving the context restores correctly rounded division (and clears the compile cache).
    np.testing.assert_array_equal(np.asarray(jax.jit(jnp.divide)(a, b)), exact)


def test_fma_contraction_rounds_multiply_add_once():
    x = np.float32(1 + 2**-12)
    c = np.float32(1 + 2**-11)
    fused = np.float32(np.float64(x) * np.float64(x) - np.float64(c))  # 2**-24 exactly
    unfused = np.float32(x * x) - c  # x*x rounds away its 2**-24 first: 0
    assert fused == 2.0**-24 and unfused == 0
    xs, cs = jnp.full((8,), x), jnp.full((8,), c)
    with fma_contraction():
        np.testing.assert_array_equal(jax.jit(lambda a, b, z: a * b - z)(xs, xs, cs), fused)
        np.testing.assert_array_equal(jax.jit(lambda a, b, z: z - a * b)(xs, xs, cs), -fused)
        np.testing.assert_array_equal(jax.jit(lambda a, b, z: a * b + z)(xs, xs, -cs), fused)
        # Eagerly the multiply and the subtract are separate computations: nothing to fuse.
        np.testing.assert_array_equal(xs * xs - cs, unfused)
    # Note: XLA:CPU itself contracts a multiply and an add inside one fused loop, so jitted
    # code is contracted without the fixture too, and eager code is not: the quantizer tests
    # run each path both ways, and must give the same bits.
    np.testing.assert_array_equal(jax.jit(lambda a, b, z: a * b - z)(xs, xs, cs), fused)
    np.testing.assert_array_equal(xs * xs - cs, unfused)


def _dividing_quantizer_codes(x):
    """Spec section 2 in jnp the way it reads, with float divisions (as the package did before
    its scale arithmetic was made exact): codes only, round to nearest."""
    xb = x.astype(jnp.float32).reshape(x.shape[0], -1, 16)
    amax_b = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    s_enc = jnp.minimum(2688.0 / jnp.max(amax_b), np.finfo(np.float32).max)
    s_dec = 1.0 / s_enc
    s_b = jnp.clip(amax_b * (s_enc * np.float32(1 / 6)), 0, 448)
    s_b = s_b.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    y = jnp.clip(xb * jnp.minimum(1.0 / (s_b * s_dec), np.finfo(np.float32).max), -6, 6)
    return y.astype(jnp.float4_e2m1fn).reshape(x.shape)


def test_the_emulation_catches_a_quantizer_that_divides():
    x = tie_rich_data(1, (128, 128))
    want = ref_quantize(x)[0]
    to_codes = lambda v: np.asarray(v).view(np.uint8) & 0xF  # noqa: E731
    ieee = to_codes(jax.jit(_dividing_quantizer_codes)(jnp.asarray(x, jnp.bfloat16)))
    # float4 casts write -0 as 0x8 like our codes; only compare values' codes where non-zero.
    nonzero = np.asarray(want) % 8 != 0
    np.testing.assert_array_equal(ieee[nonzero], want[nonzero])
    with faithful_division():
        gpu_like = to_codes(jax.jit(_dividing_quantizer_codes)(jnp.asarray(x, jnp.bfloat16)))
    assert (gpu_like[nonzero] != want[nonzero]).mean() > 0.01
    assert x.dtype == np.float32 and (x == x.astype(ml_dtypes.bfloat16).astype(np.float32)).all()
