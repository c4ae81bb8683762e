"""MXFP4 baseline: 32-element blocks, E8M0 power-of-two scales (spec section 10)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from nvfp4_jax.quant import MXFP4Tensor, dequantize, dequantize_mxfp4, quantize_mxfp4
from nvfp4_jax.quant.formats import unpack_nibbles

# Every test runs under IEEE and under GPU-legal float32 arithmetic (tests/quant/conftest.py).
pytestmark = pytest.mark.usefixtures("arithmetic")

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
quantize_jit = jax.jit(quantize_mxfp4, static_argnames="axis")


def ref_codes(y):
    """E2M1 codes by ml_dtypes' float4 cast (RNE; one byte per element, the code in bits 0-3)."""
    return np.asarray(y, np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


def ref_mxfp4(x):
    """Blocks of 32 along the last axis: e = clamp(ceil(log2(fl32(amax_b / 6))), -127, 127)."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(*x.shape[:-1], -1, 32)
    v = np.abs(xb).max(-1) / np.float32(6)  # float32 division, as TE
    m, ex = np.frexp(v.astype(np.float64))  # v = m * 2**ex, m in [0.5, 1): exact
    e = np.where(m == 0.5, ex - 1, ex)
    e = np.clip(np.where(v == 0, -127, e), -127, 127)
    y = np.clip(xb.astype(np.float64) / 2.0 ** e[..., None], -6, 6)  # exact: a power of two
    return ref_codes(y).reshape(x.shape), (e + 127).astype(np.uint8)


def scale_bytes(q):
    return np.asarray(lax.bitcast_convert_type(q.scales, jnp.uint8))


@pytest.mark.parametrize("jit", [False, True])
def test_hand_vectors(jit):
    # Block 0: amax 6 -> 6/6 = 1 -> e = 0 (byte 127); plain E2M1 rounding incl. ties.
    # Block 1: amax 12 -> 2 = 2**1 exactly -> e = 1 (ceil of an exact log2 does not round up).
    # Block 2: amax 12.5 -> 2.08 -> e = 2; 12.5 / 4 = 3.125 -> 3. Block 3: all zero -> e = -127.
    # Block 4: amax 1e-30 -> 1.67e-31 -> log2 = -102.2 -> e = -102; 1e-30 * 2**102 = 5.07 -> 6,
    # -2e-31 * 2**102 = -1.01 -> -1.
    x = np.zeros((1, 160), np.float32)
    x[0, :9] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25]
    x[0, 32:35] = [12.0, 3.0, 5.0]
    x[0, 64:66] = [12.5, -12.5]
    x[0, 128:130] = [1e-30, -2e-31]
    q = (quantize_jit if jit else quantize_mxfp4)(jnp.asarray(x))
    assert isinstance(q, MXFP4Tensor) and q.codes.shape == (1, 80) and q.scales.shape == (1, 5)
    assert q.scales.dtype == jnp.float8_e8m0fnu
    assert scale_bytes(q).tolist() == [[127, 128, 129, 0, 25]]
    codes = np.asarray(unpack_nibbles(q.codes, 1))[0]
    assert codes[:9].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8]
    assert codes[32:35].tolist() == [7, 3, 4] and codes[64:66].tolist() == [5, 13]
    assert (codes[96:128] == 0).all() and codes[128:130].tolist() == [7, 10]
    dq = np.asarray(dequantize(q))[0]
    np.testing.assert_array_equal(dq[:9], [6, 0, 1, 1, 2, 2, 4, 4, -0.0])
    np.testing.assert_array_equal(dq[32:35], [12, 3, 4])
    np.testing.assert_array_equal(dq[64:66], [12, -12])
    np.testing.assert_array_equal(dq[128:130], np.float32([6 * 2.0**-102, -(2.0**-102)]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_reference(dtype, jit=True):  # eager mode: see test_hand_vectors
    rng = np.random.default_rng(0)
    mag = np.exp(3 * rng.standard_normal((32, 2, 1)))
    mag[0, 0] = 0.0
    x = jnp.asarray((rng.standard_normal((32, 2, 32)) * mag).reshape(32, 64), dtype)
    q = (quantize_jit if jit else quantize_mxfp4)(x)
    codes, sbytes = ref_mxfp4(np.asarray(x.astype(jnp.float32)))
    np.testing.assert_array_equal(unpack_nibbles(q.codes, 1), codes)
    np.testing.assert_array_equal(scale_bytes(q), sbytes)
    want = np.array([*GRID, *-GRID], np.float32)[codes] * np.repeat(2.0 ** (sbytes.astype(np.float64) - 127), 32, 1)
    np.testing.assert_array_equal(jax.jit(dequantize_mxfp4)(q), want.astype(np.float32))


def test_axis_and_error_bound():
    x = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32)
    q = quantize_jit(x, axis=0)
    assert q.codes.shape == (32, 32) and q.scales.shape == (2, 32)
    dq = np.asarray(jax.jit(dequantize)(q))
    np.testing.assert_array_equal(dq, np.asarray(jax.jit(dequantize)(quantize_jit(x.T))).T)
    # Power-of-two scales waste up to a factor 2 of range: error <= 2**e (half of step 2).
    err = np.abs(dq - np.asarray(x))
    e = np.repeat(np.asarray(q.scales.astype(jnp.float32)), 32, 0)
    assert (err <= e).all()
    rel = np.linalg.norm(err) / np.linalg.norm(np.asarray(x))
    assert 0.05 < rel < 0.2


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_gives_all_nan(bad):
    x = jax.random.normal(jax.random.key(1), (256, 1024), jnp.float32).at[100, 517].set(bad)
    assert np.isnan(np.asarray(jax.jit(dequantize)(quantize_jit(x)))).all()


def test_errors():
    with pytest.raises(ValueError, match=r"quantize_mxfp4: the block axis \(axis=1\) has length 48; it must be a multiple of 32"):
        quantize_mxfp4(jnp.zeros((4, 48)))
    with pytest.raises(ValueError, match=r"quantize_mxfp4: x has dtype int8"):
        quantize_mxfp4(jnp.zeros((4, 64), jnp.int8))
