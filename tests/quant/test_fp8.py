"""FP8 with a per-tensor scale (the FP8 baselines)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nvfp4_jax.quant import FP8Tensor, dequantize, dequantize_fp8, quantize_fp8

# Every test runs under IEEE and under GPU-legal float32 arithmetic (tests/quant/conftest.py).
pytestmark = pytest.mark.usefixtures("arithmetic")

NP_DTYPES = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
quantize_jit = jax.jit(quantize_fp8, static_argnames="fmt")


def ref_fp8(x, scale, fmt):
    dt, fmax = NP_DTYPES[fmt]
    y = np.clip(np.asarray(x, np.float32) * np.float32(scale), -fmax, fmax).astype(np.float32)
    return y.astype(dt), np.float32(1) / np.float32(scale)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("jit", [False, True])
def test_matches_reference(fmt, jit):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((32, 64)) * np.exp(2 * rng.standard_normal((32, 1)))).astype(np.float32)
    x[0, :4] = [1e6, -1e6, 0.0, -0.0]  # saturates instead of becoming NaN / Inf
    scale = np.float32(448.0 / 37.0)
    q = (quantize_jit if jit else quantize_fp8)(jnp.asarray(x), scale, fmt=fmt)
    data, scale_inv = ref_fp8(x, scale, fmt)
    assert isinstance(q, FP8Tensor) and q.fmt == fmt and q.data.dtype == data.dtype
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))
    assert np.float32(q.scale_inv) == scale_inv
    assert np.float32(q.amax) == np.abs(x).max()
    want = data.astype(np.float32) * scale_inv
    np.testing.assert_array_equal(dequantize(q), want)
    # Under jit the f32 -> f8 -> f32 round trip must not be optimized away.
    dq = jax.jit(lambda a: dequantize_fp8(quantize_fp8(a, scale, fmt)))(jnp.asarray(x))
    np.testing.assert_array_equal(dq, want)


def test_by_hand():
    # E4M3: ties to even (1.0625 -> 1, 1.1875 -> 1.25), saturation at 448, 0.001 = 0.512 * 2**-9
    # rounds to the smallest subnormal.
    x = jnp.array([1.0, 1.0625, 1.1875, 500.0, -500.0, 0.001], jnp.float32)
    q = quantize_fp8(x, 1.0)
    assert np.asarray(q.data).astype(np.float32).tolist() == [1.0, 1.0, 1.25, 448.0, -448.0, 2.0**-9]
    q = quantize_fp8(x, 2.0, fmt="e5m2")  # 2.125 -> 2 (tie to even), 2.375 -> 2.5
    assert np.asarray(q.data).astype(np.float32).tolist()[:3] == [2.0, 2.0, 2.5]
    assert float(q.scale_inv) == 0.5
    np.testing.assert_array_equal(dequantize(q, jnp.bfloat16), dequantize(q).astype(jnp.bfloat16))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_gives_all_nan(bad):
    x = jax.random.normal(jax.random.key(0), (256, 1024), jnp.float32).at[3, 1000].set(bad)
    q = quantize_jit(x, 1.0)
    assert np.isnan(np.asarray(dequantize(q))).all() and np.isnan(float(q.amax))


def test_errors():
    with pytest.raises(ValueError, match=r"fmt='e3m4' is not supported; allowed: \['e4m3', 'e5m2'\]"):
        quantize_fp8(jnp.zeros(4), 1.0, fmt="e3m4")
    with pytest.raises(ValueError, match=r"x has dtype int32"):
        quantize_fp8(jnp.zeros(4, jnp.int32), 1.0)
    with pytest.raises(ValueError, match=r"scale must be a scalar; got shape \(2,\)"):
        quantize_fp8(jnp.zeros(4), jnp.ones(2))
