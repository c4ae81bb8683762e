"""The 16-point Random Hadamard Transform (spec section 5)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nvfp4_jax.nvfp4_spec import ref_rht_last_axis
from nvfp4_jax.quant import (
    dequantize,
    hadamard_matrix,
    inverse_random_hadamard_transform,
    quantize_nvfp4,
)
from nvfp4_jax.quant import random_hadamard_transform as rht

# Every test runs under IEEE and under GPU-legal float32 arithmetic (tests/quant/conftest.py).
pytestmark = pytest.mark.usefixtures("arithmetic")

SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float64)
rht_jit = jax.jit(rht, static_argnums=1)
inv_jit = jax.jit(inverse_random_hadamard_transform, static_argnums=1)


def sylvester16() -> np.ndarray:
    h = np.array([[1.0]])
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    return h


def ref_rht_float64(x: np.ndarray) -> np.ndarray:
    """bf16 input, exact float64 products and sums, rounded to float32 then bf16."""
    r = np.diag(SIGNS) @ sylvester16() / 4
    xb = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    y = (xb.reshape(-1, 16) @ r).reshape(xb.shape)
    return y.astype(np.float32).astype(ml_dtypes.bfloat16)


def test_matrix_by_hand():
    r = np.asarray(hadamard_matrix(), np.float64)
    np.testing.assert_array_equal(r, np.diag(SIGNS) @ sylvester16() / 4)
    # H16[i, j] = (-1)^popcount(i & j); entries +-0.25, exact in bf16.
    i = np.arange(16)
    pop = np.array([[bin(a & b).count("1") for b in i] for a in i])
    np.testing.assert_array_equal(r, SIGNS[:, None] * (-1.0) ** pop / 4)
    np.testing.assert_array_equal(np.asarray(hadamard_matrix(jnp.bfloat16), np.float64), r)
    # Orthogonal, exactly.
    np.testing.assert_array_equal(r @ r.T, np.eye(16))


@pytest.mark.parametrize("jit", [False, True])
def test_transform_matches_float64_reference(jit):
    # Small integers times a power of two: every 16-term fp32 sum is exact, so the result is
    # independent of accumulation order and must match bit for bit.
    rng = np.random.default_rng(0)
    x = (rng.integers(-128, 128, (32, 64)) * 2.0**-5).astype(np.float32)
    y = (rht_jit if jit else rht)(jnp.asarray(x), -1)
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y), ref_rht_float64(x))


def test_transform_gaussian_bf16_rounding():
    # Ordinary data: fp32 accumulation order can only matter in rare double-rounding cases.
    x = np.asarray(jax.random.normal(jax.random.key(1), (256, 256), jnp.float32))
    y = np.asarray(rht_jit(jnp.asarray(x), -1))
    assert (y != ref_rht_float64(x)).mean() < 1e-4


@pytest.mark.parametrize("jit", [False, True])
def test_transform_is_the_fixed_order_butterfly(jit):
    # Wide-range bf16 data, where some 16-term sums round in fp32: the result must be the
    # butterfly's (docs/numerics.md), bitwise, for contiguous blocks (last axis) and for strided
    # blocks (axis 0, the WGRAD copies), which use different XLA formulations of the same adds.
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((64, 64)) * np.exp(rng.standard_normal((64, 64)) * 6)).astype(np.float32)
    # Blocks (2**20, 2**-10, -2**20, 0, ...): the butterfly adds 2**-10 to 2**20 first, where
    # fp32 drops it, then cancels the 2**20s; the exact sum keeps it (outputs +-2**-12, not 0).
    x[::4, :16] = 0.0
    x[::4, :3] = [2.0**20, 2.0**-10, -(2.0**20)]
    want = ref_rht_last_axis(x)
    exact = ref_rht_float64(x)
    assert (want.view(np.uint16) != exact.view(np.uint16)).any()  # the order shows here
    fn = rht_jit if jit else rht
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x), -1)).view(np.uint16), want.view(np.uint16))
    got0 = np.asarray(fn(jnp.asarray(x.T), 0)).T
    np.testing.assert_array_equal(got0.view(np.uint16), want.view(np.uint16))


def test_axes():
    x = jax.random.normal(jax.random.key(2), (32, 64), jnp.float32)
    np.testing.assert_array_equal(rht_jit(x, 0), rht_jit(x.T, -1).T)
    x3 = jax.random.normal(jax.random.key(3), (2, 32, 4), jnp.float32)
    want = jnp.moveaxis(rht_jit(jnp.moveaxis(x3, 1, 2), -1), 2, 1)
    np.testing.assert_array_equal(rht_jit(x3, 1), want)


def test_inverse_recovers_input_up_to_bf16():
    x = jax.random.normal(jax.random.key(4), (32, 64), jnp.float32)
    back = np.asarray(inv_jit(rht_jit(x, 0), 0))
    # Two bf16 roundings (input, output), each <= 2**-9 relative, spread by an orthogonal map.
    err = np.abs(back - np.asarray(x)).reshape(2, 16, 64)
    norm = np.linalg.norm(np.asarray(x).reshape(2, 16, 64), axis=1, keepdims=True)
    assert (err <= 2 * 2.0**-8 * norm).all()
    # Exact when nothing rounds: small integers rotate to multiples of 1/4 below 32.
    xi = jnp.asarray(np.random.default_rng(4).integers(-8, 9, (32, 64)).astype(np.float32))
    np.testing.assert_array_equal(inv_jit(rht_jit(xi, 0), 0), xi)


def test_wgrad_transform_cancels():
    # (X^T R)(dY^T R)^T = X^T dY: R is orthogonal (in exact arithmetic).
    r = np.asarray(hadamard_matrix(), np.float64)
    rng = np.random.default_rng(5)
    xt, dyt = rng.standard_normal((8, 32)), rng.standard_normal((4, 32))
    rot = lambda m: (m.reshape(-1, 16) @ r).reshape(m.shape)
    np.testing.assert_allclose(rot(xt) @ rot(dyt).T, xt @ dyt.T, rtol=1e-12, atol=1e-12)


def test_quantize_rht_takes_amax_after_transform():
    x = np.zeros((32, 64), np.float32)
    x[:16, 0] = 1.0  # ones: y_j = sum_k s_k H[k, j] / 4, e.g. y_0 = (6 - 10) / 4 = -1
    x[0, 1] = 8.0  # a spike of 8 spreads to 8 * R[0, j] = +-2 along its 16-vector
    xj = jnp.asarray(x)
    q = jax.jit(quantize_nvfp4, static_argnames=("axis", "rht"))(xj, axis=0, rht=True)
    y = np.asarray(rht_jit(xj, 0).astype(jnp.float32))
    assert y[0, 0] == -1.0 and (np.abs(y[:16, 1]) == 2.0).all()
    assert float(q.amax) == np.abs(y).max() == 2.0 and q.rht
    assert np.abs(x).max() == 8.0
    # The quantized tensor is in the rotated domain: it equals quantizing the rotated input.
    q_ref = jax.jit(quantize_nvfp4, static_argnames="axis")(jnp.asarray(y), axis=0)
    np.testing.assert_array_equal(q.codes, q_ref.codes)
    np.testing.assert_array_equal(jax.jit(dequantize)(q), jax.jit(dequantize)(q_ref))


def test_rht_error_message():
    with pytest.raises(ValueError, match=r"axis 0 has length 24; it must be a multiple of 16"):
        rht(jnp.zeros((24, 16)), 0)
