"""Formats: E2M1 rounding and codes, E4M3/E5M2 casts, nibble packing, exact division."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from nvfp4_jax.quant import formats as F

# Every test runs under IEEE and under GPU-legal float32 arithmetic (tests/quant/conftest.py).
pytestmark = pytest.mark.usefixtures("arithmetic")

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def ref_e2m1_code(v: float) -> int:
    """Nearest E2M1 grid point in float64, ties to the even code (= even mantissa)."""
    a = abs(float(v))
    d = np.abs(GRID - a)
    best = np.flatnonzero(d == d.min())
    idx = int(best[0]) if len(best) == 1 else int(best[best % 2 == 0][0])
    return idx | (8 if np.signbit(v) else 0)


def _u8(x):
    return np.asarray(lax.bitcast_convert_type(x, jnp.uint8))


def _e2m1_test_points() -> np.ndarray:
    """Every grid point and midpoint, their float32 neighbours, both signs, and random fill."""
    key = np.concatenate([GRID, (GRID[:-1] + GRID[1:]) / 2]).astype(np.float32)
    near = np.concatenate([key, np.nextafter(key, np.float32(-1)), np.nextafter(key, np.float32(7))])
    rand = np.random.default_rng(0).uniform(0, 6, 4000).astype(np.float32)
    pts = np.clip(np.concatenate([near, rand, [1e-30, 1e-8]]), 0, 6).astype(np.float32)
    return np.concatenate([pts, -pts])


def test_e2m1_table_and_values():
    assert F.E2M1_VALUES.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    vals = np.asarray(F.e2m1_values(jnp.arange(16, dtype=jnp.uint8)))
    np.testing.assert_array_equal(vals, F.E2M1_VALUES)
    assert np.signbit(vals[8]) and not np.signbit(vals[0])  # 0x8 is -0
    # Higher bits are ignored (a packed byte's other nibble).
    np.testing.assert_array_equal(F.e2m1_values(jnp.arange(16, 32, dtype=jnp.uint8)), F.E2M1_VALUES)


@pytest.mark.parametrize("jit", [False, True])
def test_e2m1_rn_ties_by_hand(jit):
    # Spec section 2 step 5: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, >5 -> 6.
    y = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, -0.25, -5.0, 6.0, -6.0], np.float32)
    want = [0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x7, 0x8, 0xE, 0x7, 0xF]
    fn = jax.jit(F.e2m1_rn_codes) if jit else F.e2m1_rn_codes
    assert np.asarray(fn(jnp.asarray(y))).tolist() == want


@pytest.mark.parametrize("jit", [False, True])
def test_e2m1_rn_codes_match_float64_and_ml_dtypes(jit):
    y = _e2m1_test_points()
    fn = jax.jit(F.e2m1_rn_codes) if jit else F.e2m1_rn_codes
    got = np.asarray(fn(jnp.asarray(y)))
    want = np.array([ref_e2m1_code(v) for v in y])
    np.testing.assert_array_equal(got, want)
    # ml_dtypes' float4 cast (independent) agrees on values; E2M1 in ml_dtypes is 1 byte/elem.
    np.testing.assert_array_equal(F.E2M1_VALUES[got], y.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_e2m1_codes_of_grid_values():
    codes = F.e2m1_codes(jnp.asarray(F.E2M1_VALUES))
    np.testing.assert_array_equal(codes, np.arange(16))


@pytest.mark.parametrize("jit", [False, True])
def test_stochastic_rounding_by_hand(jit):
    fn = jax.jit(F.round_e2m1_stochastic) if jit else F.round_e2m1_stochastic
    # 1.25 (step 0.5, frac 0.5): rounds up iff r >= 128. 5.0 (step 2, frac 0.5): up iff r >= 128.
    # 0.1 (step 0.5, frac 0.2): up iff r >= 256 - floor(256 * 0.2) = 205 (t = 0.1 + r/512).
    r = jnp.arange(256, dtype=jnp.uint8)
    for y, lo, hi, thresh in [(1.25, 1.0, 1.5, 128), (5.0, 4.0, 6.0, 128), (-1.25, -1.0, -1.5, 128)]:
        out = np.asarray(fn(jnp.full(256, y, jnp.float32), r))
        np.testing.assert_array_equal(out, np.where(np.arange(256) >= thresh, hi, lo))
    out = np.asarray(fn(jnp.full(256, 0.1, jnp.float32), r))
    n_up = int((out == 0.5).sum())
    assert n_up == int(np.floor(256 * (0.1 / 0.5))) and set(out.tolist()) <= {0.0, 0.5}
    # On-grid values never move, for every possible random byte; 6 never exceeds 6.
    for v in F.E2M1_VALUES:
        out = np.asarray(fn(jnp.full(256, v, jnp.float32), r))
        np.testing.assert_array_equal(out, np.full(256, v, np.float32))


def test_pack_unpack_by_hand():
    codes = jnp.array([[1, 2, 3, 4, 0xF, 0x8]], jnp.uint8)
    packed = F.pack_nibbles(codes, axis=-1)
    assert np.asarray(packed).tolist() == [[0x21, 0x43, 0x8F]]  # element 2i in the low nibble
    np.testing.assert_array_equal(F.unpack_nibbles(packed, -1), codes)
    packed0 = F.pack_nibbles(codes.T, axis=0)
    assert np.asarray(packed0).tolist() == [[0x21], [0x43], [0x8F]]


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_pack_roundtrip_any_axis(axis):
    codes = jnp.asarray(np.random.default_rng(axis).integers(0, 16, (4, 6, 8)).astype(np.uint8))
    packed = jax.jit(F.pack_nibbles, static_argnums=1)(codes, axis)
    assert packed.shape[axis] == codes.shape[axis] // 2 and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(jax.jit(F.unpack_nibbles, static_argnums=1)(packed, axis), codes)
    lo = np.take(np.asarray(codes), np.arange(0, codes.shape[axis], 2), axis=axis)
    np.testing.assert_array_equal(np.asarray(packed) & 0xF, lo)


def test_pack_odd_length_raises():
    with pytest.raises(ValueError, match="odd length 3"):
        F.pack_nibbles(jnp.zeros((2, 3), jnp.uint8))


def _e4m3_test_points() -> np.ndarray:
    finite = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    pos = np.unique(finite[np.isfinite(finite) & (finite >= 0)])
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    pts = np.concatenate(
        [pos.astype(np.float32), mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e4))]
    )
    return np.concatenate([pts, -pts, [464.0, 500.0, 1e30, -1e30]]).astype(np.float32)


@pytest.mark.parametrize("jit", [False, True])
def test_e4m3_cast_rne_saturating(jit):
    v = _e4m3_test_points()
    want = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    fn = jax.jit(F.round_to_e4m3) if jit else F.round_to_e4m3
    got = fn(jnp.asarray(v))
    assert got.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(_u8(got), want.view(np.uint8))
    # By hand: ties to even, saturation instead of NaN, subnormal ties.
    hand = np.array([1.0625, 1.1875, 17.0, 19.0, 464.0, 2.0**-10, 1.5 * 2.0**-9], np.float32)
    assert _u8(fn(jnp.asarray(hand))).tolist() == [0x38, 0x3A, 0x58, 0x5A, 0x7E, 0x00, 0x02]


def test_e4m3_round_trip_not_dropped_under_jit():
    v = jnp.asarray(_e4m3_test_points())
    out = jax.jit(lambda a: F.fp8_to_f32(F.round_to_e4m3(a)))(v)
    want = np.clip(np.asarray(v), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(out, want)


def test_saturating_cast_e5m2_and_nan():
    v = jnp.array([57344.0, 61440.0, 1e9, -1e9, 1.0, jnp.nan], jnp.float32)
    out = np.asarray(jax.jit(lambda a: F.saturating_cast(a, jnp.float8_e5m2))(v)).astype(np.float32)
    assert out[:5].tolist() == [57344.0, 57344.0, 57344.0, -57344.0, 1.0] and np.isnan(out[5])
    assert np.isnan(np.asarray(F.round_to_e4m3(jnp.array([jnp.nan]))).astype(np.float32)[0])


def test_abs_bits_amax_keeps_nan_and_inf():
    x = jnp.zeros((256, 1024), jnp.float32).at[200, 1000].set(jnp.nan)
    lay = F.block_layout(x.shape, 1, 16)
    _, amax = jax.jit(lambda v: F.block_amax_bits(v.reshape(lay.blocked), lay))(x)
    assert bool(F.is_nonfinite_bits(amax))
    _, amax = F.block_amax_bits(x.at[200, 1000].set(-jnp.inf).reshape(lay.blocked), lay)
    assert bool(F.is_nonfinite_bits(amax)) and F.bits_to_f32(amax) == jnp.inf


def test_pow2_and_e8m0():
    e = jnp.arange(-127, 128)
    # Results down to 2**-126 (2**-127 is a float32 subnormal, which XLA CPU flushes).
    np.testing.assert_array_equal(F.mul_pow2(jnp.full(254, 4.0), e[1:] - 2), 2.0 ** np.arange(-126.0, 128.0))
    np.testing.assert_array_equal(F.mul_pow2(jnp.full(2, 3.0), jnp.array([-127, 126])), [1.5 * 2.0**-126, 1.5 * 2.0**127])
    s = F.e8m0_from_exponent(e)
    assert s.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(F.e8m0_exponent(s), e)
    np.testing.assert_array_equal(np.asarray(s).astype(np.float64), 2.0 ** np.arange(-127.0, 128.0))


def test_block_layout():
    lay = F.block_layout((4, 32, 3), 1, 16)
    assert lay.blocked == (4, 2, 16, 3) and lay.scale_shape == (4, 2, 3) and lay.keepdims == (4, 2, 1, 3)
    lay = F.block_layout((32, 48), 0, 16, two_d=True)
    assert lay.blocked == (2, 16, 3, 16) and lay.scale_shape == (2, 3) and lay.keepdims == (2, 1, 3, 1)
    assert F.block_layout((8, 64), 1, 32).blocked == (8, 2, 32)
