"""Integer-built float32 arithmetic against numpy's IEEE float32 (which keeps subnormals)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from bitwise import assert_same_floats as _assert_same_floats

from nvfp4_jax.quant import exact

# Every test runs under IEEE and under GPU-legal float32 arithmetic (tests/quant/conftest.py).
pytestmark = pytest.mark.usefixtures("arithmetic")

SPECIAL = np.array(
    [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 2688.0, 6.0, 448.0, 3.0, 1 / 3,
     np.finfo(np.float32).max, np.finfo(np.float32).tiny, np.finfo(np.float32).smallest_subnormal,
     -np.finfo(np.float32).smallest_subnormal, 1e-40, 3e-39, 1.5e-45, 1e38, 7.9e-36, 2.9e-39],
    np.float32,
)


def operands(seed, n=4096):
    """Random bit patterns (every class of float32: NaN, Inf, zero, subnormal, normal), random
    normals of moderate size, and every pair of special values."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 2**32, size=(2, n), dtype=np.uint64).astype(np.uint32).view(np.float32)
    sub = (rng.integers(1, 2**23, size=(2, n // 4)).astype(np.uint32)).view(np.float32)
    normal = (rng.standard_normal((2, n)) * np.exp(rng.standard_normal((2, n)) * 20)).astype(np.float32)
    a_s, b_s = np.meshgrid(SPECIAL, SPECIAL)
    a = np.concatenate([raw[0], sub[0], normal[0], normal[0], a_s.ravel()])
    b = np.concatenate([raw[1], normal[1], sub[1], normal[1] * 3, b_s.ravel()])
    return a, b


def assert_same_floats(got, want):
    _assert_same_floats(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("op,ref", [(exact.div, np.divide), (exact.mul, np.multiply)])
def test_matches_ieee(op, ref, jit):
    a, b = operands(0)
    with np.errstate(all="ignore"):
        want = ref(a, b)
    got = (jax.jit(op) if jit else op)(jnp.asarray(a), jnp.asarray(b))
    assert_same_floats(got, want)


E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


@pytest.mark.parametrize("side", ["numerator", "denominator"])
@pytest.mark.parametrize("constant", [1.0, 2688.0, -3.0, 448.0, 1 / 3, 0.0, np.inf, np.nan,
                                      float(np.finfo(np.float32).max), 1e-40])
def test_division_by_or_of_a_constant_matches_ieee(constant, side):
    # The factors' divisions have a constant side (2688 / amax, amax / 2688, 1 / S_enc): every
    # class of the other operand, eagerly and under jit.
    x = np.concatenate(operands(3))
    c = np.float32(constant)
    with np.errstate(all="ignore"):
        want = c / x if side == "numerator" else x / c
    got = exact.div(constant, jnp.asarray(x)) if side == "numerator" else exact.div(jnp.asarray(x), constant)
    assert_same_floats(got, want)
    assert_same_floats(jax.jit(lambda v: exact.div(constant, v) if side == "numerator" else exact.div(v, constant))(x), want)


def test_product_of_the_e4m3_values_and_any_scale_matches_ieee():
    # What the per-tensor factors' table multiplies (the 256 E4M3 values, 0 and NaN among them)
    # by every class of scale, subnormal products included.
    a, b = operands(4, n=512)
    c = E4M3_VALUES
    x = np.concatenate([b[:256], np.float32(2.0) ** np.arange(-149, 107, dtype=np.float32)])[:, None]
    with np.errstate(all="ignore"):
        want = c[None, :] * x
    assert_same_floats(jax.jit(lambda v: exact.mul(c, v))(x), want)
    assert_same_floats(jax.jit(lambda v: exact.mul(v, c))(x), want)


def test_division_of_exactly_representable_quotients_and_ties():
    # q * b for 24-bit q and small b: the quotient is exact; halfway products test the rounding.
    rng = np.random.default_rng(1)
    q = (rng.integers(2**23, 2**24, 2000) * 2.0 ** rng.integers(-140, 100, 2000)).astype(np.float32)
    b = rng.integers(1, 64, 2000).astype(np.float32)
    prod = (q.astype(np.float64) * b)
    keep = prod < np.finfo(np.float32).max
    prod, b = prod[keep].astype(np.float32), b[keep]
    with np.errstate(all="ignore"):
        want = prod / b
    assert_same_floats(jax.jit(exact.div)(prod, b), want)


@pytest.mark.parametrize(
    "dtype,mantissa_bits,min_exp",
    [(ml_dtypes.float8_e4m3fn, 3, -6), (ml_dtypes.float8_e5m2, 2, -14), (np.float16, 10, -14)],
)
def test_round_to_grid_is_the_cast(dtype, mantissa_bits, min_exp):
    rng = np.random.default_rng(2)
    fmax = float(ml_dtypes.finfo(dtype).max)
    x = (rng.standard_normal(20000) * np.exp(rng.standard_normal(20000) * 6)).astype(np.float32)
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    # Exact ties between neighbours of the target grid, and values one float32 ulp either side.
    grid = np.abs(rng.choice(x, 3000))
    grid = np.unique(grid[grid <= fmax].astype(dtype).astype(np.float32))
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    x = np.concatenate([x, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), -mids,
                        np.array([0.0, -0.0, tiny / 2, tiny, 1e-45], np.float32)])
    x = x[np.abs(x) <= fmax]
    want = x.astype(dtype).astype(np.float32)
    got = jax.jit(lambda v: exact.round_to_grid(v, mantissa_bits, min_exp))(x)
    assert_same_floats(got, want)
    assert_same_floats(exact.round_to_grid(jnp.array([np.nan, np.inf, -np.inf], jnp.float32), 3, -6),
                       np.array([np.nan, np.inf, -np.inf], np.float32))

