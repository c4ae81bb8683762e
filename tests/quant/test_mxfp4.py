"""MXFP4: 32-element blocks, E8M0 power-of-two scales (spec section 10); and the NVFP4 recipe's
operand handling on that format (32x32 weight tiles, the RHT, stochastic rounding)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from nvfp4_jax.quant import (
    MXFP4Tensor,
    dequantize,
    dequantize_mxfp4,
    inverse_random_hadamard_transform,
    quantize_mxfp4,
    random_hadamard_transform,
)
from nvfp4_jax.quant.formats import stochastic_rounding_bits, unpack_nibbles

# Every test runs under IEEE and under GPU-legal float32 arithmetic (tests/quant/conftest.py).
pytestmark = pytest.mark.usefixtures("arithmetic")

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
quantize_jit = jax.jit(quantize_mxfp4, static_argnames=("axis", "two_d", "rht", "stochastic"))


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


# --- the NVFP4 recipe's operand handling on MXFP4 (mxfp4_nvfp4_recipe) -------------------------


def ref_exponent(amax):
    """clamp(ceil(log2(amax / 6)), -127, 127), exactly (float64 holds amax / 6 of a float32 amax
    closely enough that no power of two is crossed); -127 for an all-zero block."""
    m, ex = np.frexp(np.asarray(amax, np.float64) / 6.0)  # v = m * 2**ex, m in [0.5, 1)
    e = np.where(m == 0.5, ex - 1, ex)
    return np.clip(np.where(amax == 0, -127, e), -127, 127)


def ref_sr(y, noise):
    """the stochastic-rounding rule of docs/numerics.md on float32 |y| <= 6, in float32 as written there: t = |y| + u *
    step(|y|) with u = byte / 256, then t rounded down on the E2M1 grid (at most 6)."""
    def step(v):
        return np.where(v >= 4, 2.0, np.where(v >= 2, 1.0, 0.5)).astype(np.float32)

    a = np.abs(y).astype(np.float32)
    t = a + (noise.astype(np.float32) / np.float32(256)) * step(a)
    return np.copysign(np.minimum(np.floor(t / step(t)) * step(t), 6.0), y).astype(np.float32)


def ref_quantize(x, *, axis=-1, two_d=False, noise=None):
    """(codes in x's shape, scale bytes in the scale layout) of MXFP4, from numpy alone: one
    exponent per 1x32 block along `axis`, or per 32x32 tile; RN, or SR with `noise` bytes."""
    x = np.asarray(x, np.float32)
    if two_d:
        m, n = x.shape
        e = ref_exponent(np.abs(x.reshape(m // 32, 32, n // 32, 32)).max((1, 3)))
        e_full = np.repeat(np.repeat(e, 32, 0), 32, 1)
    else:
        xm = np.moveaxis(x, axis, -1)
        e = ref_exponent(np.abs(xm.reshape(*xm.shape[:-1], -1, 32)).max(-1))
        e_full = np.moveaxis(np.repeat(e, 32, -1), -1, axis)
        e = np.moveaxis(e, -1, axis)
    y = np.clip(x.astype(np.float64) / 2.0**e_full, -6, 6).astype(np.float32)  # exact
    if noise is not None:
        y = ref_sr(y, np.asarray(noise))
    return ref_codes(y), (e + 127).astype(np.uint8)


def outlier_weight(seed=0, shape=(96, 64)):
    """Gaussian weights with a large-outlier tile, a tiny tile and an all-zero tile."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w[0:32, 32:64] *= 1e-30  # tiny: scale 2**-100 or so
    w[32:64, 0:32] = 0.0
    w[64:96, 32:64] *= 1e4
    w[70, 40] = -3e5  # one outlier sets its tile's scale
    return w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_two_d_tiles_match_reference(dtype):
    x = jnp.asarray(outlier_weight(), dtype)
    q = quantize_jit(x, axis=0, two_d=True)  # axis is ignored for 2-D tiles
    assert (q.two_d, q.axis, q.codes.shape, q.scales.shape) == (True, 1, (96, 32), (3, 2))
    codes, sbytes = ref_quantize(np.asarray(x.astype(jnp.float32)), two_d=True)
    np.testing.assert_array_equal(unpack_nibbles(q.codes, 1), codes)
    np.testing.assert_array_equal(scale_bytes(q), sbytes)
    assert sbytes[1, 0] == 0 and sbytes[0, 1] < 40 and sbytes[2, 1] > 140  # zero, tiny, outlier
    want = np.array([*GRID, *-GRID], np.float32)[codes] * np.repeat(np.repeat(
        2.0 ** (sbytes.astype(np.float64) - 127), 32, 0), 32, 1)
    np.testing.assert_array_equal(jax.jit(dequantize)(q), want.astype(np.float32))


def test_two_d_quantized_weight_is_its_own_transpose():
    """One scale per 32x32 tile: Q(W)^T and Q(W^T) hold the same numbers (DGRAD reuses FPROP's
    W), which 1x32 blocks along K and along N do not."""
    w = jnp.asarray(outlier_weight(1))
    deq = jax.jit(lambda a: dequantize(quantize_mxfp4(a, two_d=True)))
    np.testing.assert_array_equal(np.asarray(deq(w)).T, np.asarray(deq(w.T)))
    along_k = np.asarray(jax.jit(dequantize)(quantize_jit(w, axis=0)))
    along_n = np.asarray(jax.jit(dequantize)(quantize_jit(w, axis=1)))
    assert not np.array_equal(along_k, along_n)


def test_rht_is_the_transform_then_the_quantizer():
    """The amax is taken after the 16-point RHT along the block axis (a block of 32 spans two
    Hadamard groups); the inverse transform of the dequantized result approximates x."""
    x = jax.random.normal(jax.random.key(2), (64, 48), jnp.float32).at[5, 7].set(40.0)
    q = quantize_jit(x, axis=0, rht=True)
    plain = quantize_jit(random_hadamard_transform(x, 0), axis=0)
    assert q.rht and not plain.rht and q.scales.shape == (2, 48)
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(plain.codes))
    np.testing.assert_array_equal(scale_bytes(q), scale_bytes(plain))
    back = np.asarray(inverse_random_hadamard_transform(jax.jit(dequantize)(q), 0))
    # Stated bound: the 1x32 RN error on Gaussian data (test_axis_and_error_bound: 5-20%).
    assert np.linalg.norm(back - np.asarray(x)) / np.linalg.norm(np.asarray(x)) < 0.2


@pytest.mark.parametrize("axis, rht", [(1, False), (0, True)])  # dY's DGRAD and WGRAD copies
def test_stochastic_rounding_matches_reference(axis, rht):
    key = jax.random.key(7)
    x = jax.random.normal(jax.random.key(3), (64, 96), jnp.float32)
    q = quantize_jit(x, axis=axis, rht=rht, stochastic=True, key=key)
    xr = np.asarray(random_hadamard_transform(x, axis) if rht else x, np.float32)
    noise = np.asarray(stochastic_rounding_bits(key, x.shape))
    codes, sbytes = ref_quantize(xr, axis=axis, noise=noise)
    np.testing.assert_array_equal(unpack_nibbles(q.codes, axis), codes)
    np.testing.assert_array_equal(scale_bytes(q), sbytes)
    rn_codes, _ = ref_quantize(xr, axis=axis)
    assert (codes != rn_codes).mean() > 0.1  # the noise really rounds some values up


def test_stochastic_rounding_leaves_grid_values_alone():
    rng = np.random.default_rng(4)
    e = rng.integers(-20, 20, (8, 4, 1)).astype(np.float64)
    x = rng.choice(np.array([*GRID, *-GRID]), (8, 4, 32)) * 2.0**e
    x[..., 0] = 6.0 * 2.0**e[..., 0]  # the block amax, so the scale is 2**e
    x = jnp.asarray(x.reshape(8, 128), jnp.float32)
    for seed in range(3):
        dq = jax.jit(dequantize)(quantize_jit(x, stochastic=True, key=jax.random.key(seed)))
        np.testing.assert_array_equal(np.asarray(dq), np.asarray(x))


def test_stochastic_rounding_is_unbiased_where_rn_is_not():
    """Every value sits 0.3 of a step above a grid point (block scale 2**0): RN always rounds
    down (bias -0.3 step), SR's mean over 64 keys is x. Stated tolerance: 4 standard errors of
    the mean plus step / 256, the most the 8-bit noise can leave (P(up) = floor(256 frac) / 256)."""
    rng = np.random.default_rng(5)
    lower = rng.choice(np.array([0.5, 1.0, 1.5, 2.0]), (32, 64))  # steps 0.5 (below 2) and 1
    step = np.where(lower >= 2, 1.0, 0.5)
    x = lower + 0.3 * step
    x[:, ::32] = 6.0
    xj = jnp.asarray(x, jnp.float32)
    keys = jax.random.split(jax.random.key(6), 64)
    draws = jax.jit(jax.vmap(lambda k: dequantize(quantize_mxfp4(xj, stochastic=True, key=k))))(keys)
    err = np.asarray(draws, np.float64) - np.asarray(xj, np.float64)
    inside = np.ones(x.shape, bool)
    inside[:, ::32] = False
    err = err[:, inside]
    se = err.std() / np.sqrt(err.size)
    assert abs(err.mean()) < 4 * se + 1.0 / 256, (err.mean(), se)
    rn_err = np.asarray(jax.jit(dequantize)(quantize_jit(xj)), np.float64)[inside] - x[inside]
    assert rn_err.mean() < -0.1


def test_recipe_argument_errors():
    x = jnp.zeros((64, 64))
    with pytest.raises(ValueError, match=r"quantize_mxfp4: stochastic=True requires a PRNG key; got key=None"):
        quantize_mxfp4(x, stochastic=True)
    with pytest.raises(ValueError, match=r"quantize_mxfp4: two_d=True needs both dims to be multiples of 32"):
        quantize_mxfp4(jnp.zeros((64, 48)), two_d=True)
    with pytest.raises(ValueError, match=r"quantize_mxfp4: two_d=True takes a 2-D weight"):
        quantize_mxfp4(jnp.zeros((2, 32, 32)), two_d=True)
    with pytest.raises(ValueError, match=r"quantize_mxfp4: rht=True is not allowed with two_d=True"):
        quantize_mxfp4(x, two_d=True, rht=True)
    with pytest.raises(ValueError, match=r"quantize_mxfp4: rht=1 must be a Python bool"):
        quantize_mxfp4(x, rht=1)


@pytest.mark.parametrize("options", [dict(axis=0, two_d=True), dict(axis=0, rht=True),
                                     dict(axis=1, stochastic=True), dict(axis=0, rht=True, stochastic=True)],
                         ids=["2d", "rht", "sr", "rht+sr"])
def test_recipe_options_give_the_same_bits_eagerly_jitted_and_under_gpu_like_arithmetic(options):
    # bf16 data full of E2M1 ties (halfway between grid points after scaling by powers of two):
    # an eager path, a jitted one and one whose float32 division is only faithfully rounded
    # (with fused multiply-adds) must agree on every code and scale.
    from backend_arithmetic import perturbed_arithmetic

    rng = np.random.default_rng(7)
    grid_mid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    x = (rng.choice(grid_mid, (64, 64)) * np.exp2(rng.integers(-3, 4, (64, 64))).astype(np.float32)
         * rng.choice([-1.0, 1.0], (64, 64)).astype(np.float32))
    x = jnp.asarray(x, jnp.bfloat16)
    key = jax.random.key(3) if options.get("stochastic") else None
    jitted = quantize_jit(x, key=key, **options)
    eager = quantize_mxfp4(x, key=key, **options)
    with perturbed_arithmetic():
        perturbed = jax.jit(quantize_mxfp4, static_argnames=("axis", "two_d", "rht", "stochastic"))(
            x, key=key, **options)
    for other in (eager, perturbed):
        np.testing.assert_array_equal(np.asarray(other.codes), np.asarray(jitted.codes))
        np.testing.assert_array_equal(np.asarray(other.scales).view(np.uint8), np.asarray(jitted.scales).view(np.uint8))
