"""NVFP4 quantizer against hand-derived vectors and a float32/float64 numpy transcription of
docs/numerics.md (nvfp4_jax/nvfp4_spec.py, written independently of the implementation), plus
properties. Every test runs under IEEE and under GPU-legal float32 arithmetic."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from tolerance import gamma

from nvfp4_jax.nvfp4_spec import (
    GRID, TIES, f32, ref_dequantize, ref_quantize, ref_rht_last_axis, spread_data, tie_rich_data,
)
from nvfp4_jax.quant import (
    NVFP4Tensor,
    dequantize,
    nvfp4_gemm_operand,
    quantize_nvfp4,
    random_hadamard_transform,
    unpack_codes,
)
from nvfp4_jax.quant.formats import stochastic_rounding_bits

# Every test runs under IEEE and under GPU-legal float32 arithmetic (tests/quant/conftest.py).
pytestmark = pytest.mark.usefixtures("arithmetic")

STATIC = ("axis", "two_d", "rht", "stochastic")
quantize_jit = jax.jit(quantize_nvfp4, static_argnames=STATIC)
operand_jit = jax.jit(nvfp4_gemm_operand, static_argnames=STATIC)
dequantize_jit = jax.jit(dequantize)


def scale_bytes(q: NVFP4Tensor) -> np.ndarray:
    return np.asarray(lax.bitcast_convert_type(q.scales, jnp.uint8))


def assert_matches_ref(q, x, two_d=False, rbits=None):
    codes, sbytes, amax, _ = ref_quantize(x, two_d=two_d, rbits=rbits)
    np.testing.assert_array_equal(unpack_codes(q), codes)
    np.testing.assert_array_equal(scale_bytes(q), sbytes)
    assert np.float32(q.amax) == amax
    np.testing.assert_array_equal(dequantize(q), ref_dequantize(codes, sbytes, amax, two_d))


# --- hand-derived vectors ---------------------------------------------------------------------


HAND = 128  # hand vectors are padded to one shape: eager mode compiles every op per shape


def _row(*blocks):
    vals = [v for b in blocks for v in b]
    return jnp.array([vals + [0.0] * (HAND - len(vals))], jnp.float32)


def _quantize_both(x, **kw):
    """Eager and jitted results; they must agree bit for bit."""
    q, qj = quantize_nvfp4(x, **kw), quantize_jit(x, **kw)
    np.testing.assert_array_equal(q.codes, qj.codes)
    np.testing.assert_array_equal(scale_bytes(q), scale_bytes(qj))
    np.testing.assert_array_equal(q.amax, qj.amax)
    return q


def test_hand_e2m1_ties_zero_block_and_underflow():
    # amax = 2688 makes S_enc = S_dec = 1. Block 1 (amax_b = 6): s_b = e4m3(6 * fl32(1/6))
    # = 1.0 (0x38), so the codes are plain E2M1 rounding of the inputs (tie cases).
    # Block 0: s_b = e4m3(2688 * fl32(1/6)) -> clip 448 (0x7E); 2688 * fl32(1/448) -> code 7.
    # Block 2: all zero -> s_b = 0, codes 0. Block 3: amax_b = 1e-6 -> s_b underflows to 0,
    # enc_b = FLT_MAX, codes saturate at +-6 and dequantize to 0.
    b0 = [2688.0] + [0.0] * 15
    b1 = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 6.0]
    b2 = [0.0] * 16
    b3 = [1e-6, -1e-6, 5e-7] + [0.0] * 13
    q = _quantize_both(_row(b0, b1, b2, b3))
    assert np.asarray(unpack_codes(q))[0, :64].tolist() == (
        [7] + [0] * 15
        + [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 7]
        + [0] * 16
        + [7, 15, 7] + [0] * 13
    )
    assert scale_bytes(q).tolist() == [[0x7E, 0x38, 0x00, 0x00, 0, 0, 0, 0]]
    assert float(q.amax) == 2688.0
    dq = np.asarray(dequantize(q))[0]
    np.testing.assert_array_equal(dq[16:32], [0, 1, 1, 2, 2, 4, 4, 6, -0.0, -1, -1, -2, -2, -4, -4, 6])
    np.testing.assert_array_equal(dq[32:64], 0.0)  # zero block and underflowed block
    assert dq[0] == 2688.0


def test_hand_op_order():
    # TE 2.14+ folds 1/6 into the global multiplier: s_b = e4m3(amax_b * fl32(S_enc * fl32(1/6))).
    # amax = 4032: S_enc = fl32(2/3), and the multiplier fl32(S_enc / 6) = 0.11111112 > 1/9.
    # Block amax 9.5625 = 9 * 1.0625 (an E4M3 tie) lands just above the tie -> 1.125 (0x39),
    # where TE <= 2.13's fl32(amax_b / 6) * S_enc hits it exactly -> 1.0 (0x38).
    # Likewise 11.8125 = 9 * 1.3125 -> 1.375 (0x3B), not 1.25 (0x3A).
    q = _quantize_both(_row([4032.0] + [0.0] * 15, [9.5625] + [0.0] * 15, [11.8125]))
    assert scale_bytes(q)[0, :3].tolist() == [0x7E, 0x39, 0x3B]
    assert np.asarray(unpack_codes(q))[0, [0, 16, 32]].tolist() == [7, 7, 7]
    # Encode by multiplying with the reciprocal. amax = 2688 (S_enc = S_dec = 1), block scale
    # 1.875: x * fl32(1 / 1.875) lands just above the E2M1 ties 1.25, 2.5, 5 -> codes 3, 5, 7,
    # where dividing by the scale gives the exact ties -> 2, 4, 6.
    q = _quantize_both(_row([2688.0] + [0.0] * 15, [11.25, 1.25 * 1.875, 2.5 * 1.875, 5.0 * 1.875]))
    assert scale_bytes(q)[0, :2].tolist() == [0x7E, 0x3F]
    assert np.asarray(unpack_codes(q))[0, 16:20].tolist() == [7, 3, 5, 7]


def test_hand_e4m3_subnormal_scales_from_one_outlier():
    # One huge outlier (amax = 2688, S_enc = S_dec = 1) pushes the other blocks' scales into
    # the E4M3 subnormal range [2**-9, 2**-6): block amax 0.03 -> 0.03 * fl32(1/6) = 0.005
    # = 2.56 * 2**-9 -> rounds to 3 * 2**-9 (byte 0x03). Block amax 0.0117 -> 1.00 * 2**-9
    # (byte 0x01). TE keeps these (torchao would clamp them to 2**-6).
    x = np.zeros((1, HAND), np.float32)
    x[0, 0] = 2688.0
    x[0, 16:20] = [0.03, -0.015, 0.0045, 0.0]
    x[0, 32:34] = [0.0117, 0.003]
    q = _quantize_both(jnp.asarray(x))
    assert scale_bytes(q)[0, :3].tolist() == [0x7E, 0x03, 0x01]
    # enc_b = fl32(1 / (3 * 2**-9)) = 170.67: 0.03 -> 5.12 -> 6; -0.015 -> -2.56 -> -3;
    # 0.0045 -> 0.768 -> 1. Block 2: enc 512: 0.0117 -> 5.99 -> 6; 0.003 -> 1.536 -> 1.5.
    codes = np.asarray(unpack_codes(q))[0]
    assert codes[16:20].tolist() == [7, 13, 2, 0] and codes[32:34].tolist() == [7, 3]
    dq = np.asarray(dequantize(q))[0]
    np.testing.assert_array_equal(dq[16:19], np.float32([6, -3, 1]) * f32(3 * 2.0**-9))


def test_hand_scale_ties_round_to_even():
    # amax = 448 gives S_enc = 6 exactly and fl32(6 * fl32(1/6)) = 1, so s_b = e4m3(amax_b):
    # E4M3 midpoints round to even: 1.0625 -> 1.0, 1.1875 -> 1.25, 17 -> 16, 19 -> 20,
    # 1.5 * 2**-9 -> 2 * 2**-9, 2**-10 -> 0.
    amaxes = [448.0, 1.0625, 1.1875, 17.0, 19.0, 1.5 * 2.0**-9, 2.0**-10]
    x = np.zeros((1, HAND), np.float32)
    x[0, : 16 * len(amaxes) : 16] = amaxes
    q = _quantize_both(jnp.asarray(x))
    assert scale_bytes(q).tolist() == [[0x7E, 0x38, 0x3A, 0x58, 0x5A, 0x02, 0x00, 0x00]]
    # y at each block max: 6.0, 6.375, 5.7, 6.375, 5.7 (code 7), 1.5 / 2 * 6 = 4.5 (tie -> 4,
    # code 6); the last block's scale underflowed: 2**-10 * FLT_MAX -> clip 6.
    assert np.asarray(unpack_codes(q))[0, ::16].tolist() == [7, 7, 7, 7, 7, 6, 7, 0]


def test_hand_negative_zero_and_values_rounding_to_zero():
    # Block 1 has s_b = 1 and enc_b = 1 (amax 2688 in block 0), so y = x exactly.
    # Values that round to zero keep their sign in the code (0x8); compare values, not codes.
    b0 = [2688.0] + [0.0] * 15
    b1 = [6.0, -0.0, 0.0, -0.1, 0.1, -0.25, 0.25] + [0.0] * 9
    q = _quantize_both(_row(b0, b1))
    codes = np.asarray(unpack_codes(q))[0, 16:23]
    assert codes[0] == 7 and codes[2] == 0x0
    assert codes[1] in (0x0, 0x8)  # exact -0.0: we give 0x8; TE's torch reference gives 0x0
    assert codes[3:].tolist() == [0x8, 0x0, 0x8, 0x0]
    dq = np.asarray(dequantize(q))[0, 16:32]
    assert dq[0] == 6.0 and (dq[1:] == 0).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_hand_constant_tensor(dtype):
    # amax_b = amax for every block: s_b = e4m3(~448) = 448, y = c * enc_b ~ 6 -> code 7,
    # and x_hat = fl32(6 * 448 * fl32(c / 2688)) = c up to two roundings: gamma(2) ~ 2**-23.
    c = 3.7
    x = jnp.full((1, HAND), c, dtype)
    q = _quantize_both(x)
    assert (np.asarray(unpack_codes(q)) == 7).all() and (scale_bytes(q) == 0x7E).all()
    cf = np.float32(jnp.asarray(c, dtype))
    assert float(q.amax) == cf
    np.testing.assert_allclose(dequantize(q), cf, rtol=gamma(2))
    qn = _quantize_both(-x)
    assert (np.asarray(unpack_codes(qn)) == 15).all()


def test_hand_all_zero_tensor():
    # amax = 0: S_enc = FLT_MAX, all scales 0, codes 0, dequantize to exactly 0 (not NaN).
    for two_d, shape in ((False, (1, HAND)), (True, (32, 64))):
        x = jnp.zeros(shape, jnp.float32)
        q = _quantize_both(x, two_d=two_d) if not two_d else quantize_jit(x, two_d=True)
        assert (np.asarray(q.codes) == 0).all() and (scale_bytes(q) == 0).all()
        assert float(q.amax) == 0.0
        assert (np.asarray(dequantize_jit(q)) == 0).all()
        v, d = operand_jit(x, two_d=two_d)
        assert (np.asarray(v) == 0).all() and float(d) == 0.0


def test_hand_2d_tile_scale():
    # 2D: one scale per 16x16 tile, from the tile's amax; codes still packed along the last axis.
    x = np.zeros((32, 64), np.float32)
    x[0, 0] = 2688.0  # tile (0, 0): s = 448
    x[17, 3] = 6.0  # tile (1, 0): s_b = 1 (S_enc = 1)
    x[31, 16] = 3.0  # tile (1, 1): s_b = e4m3(0.5) = 0.5
    x[20, 20] = 1.25  # same tile: 1.25 * 2 = 2.5 -> 2 (tie to even) -> code 4
    q = _quantize_both(jnp.asarray(x), two_d=True)
    assert q.codes.shape == (32, 32) and q.scales.shape == (2, 4)
    assert scale_bytes(q).tolist() == [[0x7E, 0, 0, 0], [0x38, 0x30, 0, 0]]
    codes = np.asarray(unpack_codes(q))
    assert codes[0, 0] == 7 and codes[17, 3] == 7 and codes[31, 16] == 7 and codes[20, 20] == 4
    assert np.asarray(q.codes)[20, 10] == 0x04  # element 20 is even: low nibble


# --- the numpy transcription on random data ---------------------------------------------------


# Eager mode compiles every op for every new shape (seconds each), so eager runs use (32, 64).
CASES = [
    ((32, 64), jnp.float32, False, False),
    ((32, 64), jnp.bfloat16, False, False),
    ((32, 64), jnp.float32, True, False),
    ((32, 64), jnp.float32, False, True),
    ((32, 64), jnp.bfloat16, True, True),
    ((48, 128), jnp.float32, False, True),
    ((64, 96), jnp.float32, True, True),
    ((16, 16), jnp.bfloat16, False, True),
    ((256, 512), jnp.bfloat16, False, True),  # 8k blocks: bf16 hits the op-order cases (~0.03%)
]


@pytest.mark.parametrize("shape,dtype,two_d,jit", CASES)
def test_matches_spec_transcription(shape, dtype, two_d, jit):
    for seed in range(3):
        x = spread_data(seed, shape, dtype=dtype)
        q = (quantize_jit if jit else quantize_nvfp4)(x, two_d=two_d)
        assert q.codes.shape == (shape[0], shape[1] // 2) and q.codes.dtype == jnp.uint8
        assert q.scales.dtype == jnp.float8_e4m3fn
        assert q.scales.shape == ((shape[0] // 16, shape[1] // 16) if two_d else (shape[0], shape[1] // 16))
        assert_matches_ref(q, np.asarray(x.astype(jnp.float32)), two_d=two_d)


@pytest.mark.parametrize("jit", [False, True])
def test_stochastic_rounding_matches_spec_transcription(jit):
    x = spread_data(7, (32, 64), sigma=1.0)
    key = jax.random.key(3)
    rbits = np.asarray(stochastic_rounding_bits(key, x.shape))
    q = (quantize_jit if jit else quantize_nvfp4)(x, stochastic=True, key=key)
    assert_matches_ref(q, np.asarray(x), rbits=rbits)


# --- bf16 data full of rounding ties: what a GPU's 1-ulp division error flips ------------------


def _tie_distance_ulps(x, two_d=False):
    """|x * enc_b - nearest tie| in float32 ulps of the tie, per element (the spec's enc_b)."""
    _, _, amax, s_b = ref_quantize(x, two_d=two_d)
    s_dec = f32(1) / np.minimum(f32(2688) / amax, np.finfo(np.float32).max)
    with np.errstate(divide="ignore"):
        enc = np.minimum(f32(1) / (s_b * s_dec), np.finfo(np.float32).max).astype(f32)
    enc = np.repeat(np.repeat(enc, 16, 0), 16, 1) if two_d else np.repeat(enc, 16, 1)
    y = np.abs(x * enc).astype(f32)
    t = TIES[np.abs(y[..., None] - TIES).argmin(-1)]
    return np.abs(y.astype(np.float64) - t) / np.spacing(t)


@pytest.mark.parametrize("two_d", [False, True])
def test_tie_rich_data_sits_on_ties(two_d):
    # The data's promise, checked with the spec: most elements are within one ulp of a tie,
    # and on both sides of it (exact ties and one ulp either way).
    x = tie_rich_data(0, (64, 64), two_d=two_d)
    assert (x == x.astype(ml_dtypes.bfloat16).astype(np.float32)).all()
    d = _tie_distance_ulps(x, two_d)
    assert (d <= 1).mean() > 0.6 and (d == 0).mean() > 0.1 and (d == 1).mean() > 0.05


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("mode", ["rn", "2d", "sr"])
def test_matches_spec_on_tie_rich_bf16(mode, jit):
    two_d, stochastic = mode == "2d", mode == "sr"
    fn = quantize_jit if jit else quantize_nvfp4
    for seed in range(2):
        x = tie_rich_data(seed, (64, 64), two_d=two_d)
        kw = dict(stochastic=True, key=jax.random.key(seed)) if stochastic else {}
        rbits = np.asarray(stochastic_rounding_bits(kw["key"], x.shape)) if stochastic else None
        q = fn(jnp.asarray(x, jnp.bfloat16), two_d=two_d, **kw)
        assert_matches_ref(q, x, two_d=two_d, rbits=rbits)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rht_matches_spec_transcription(dtype, stochastic):
    # WGRAD copies: RHT along axis 0 (tokens), blocks along axis 0; the reference works on x^T.
    x = spread_data(8, (128, 48), sigma=1.5, dtype=dtype)
    kw = dict(stochastic=True, key=jax.random.key(8)) if stochastic else {}
    q = quantize_jit(x, axis=0, rht=True, **kw)
    xt = np.asarray(ref_rht_last_axis(np.asarray(x.astype(jnp.float32)).T), np.float32)
    rbits = np.asarray(stochastic_rounding_bits(kw["key"], x.shape)).T if stochastic else None
    codes, sbytes, amax, _ = ref_quantize(xt, rbits=rbits)
    np.testing.assert_array_equal(np.asarray(unpack_codes(q)).T, codes)
    np.testing.assert_array_equal(scale_bytes(q).T, sbytes)
    assert np.float32(q.amax) == amax


# --- tiny magnitudes: what the package guarantees where float32 runs out of normal numbers ----


@pytest.mark.parametrize("two_d", [False, True])
def test_tiny_normal_tensors_are_exact(two_d):
    # amax ~ 1e-36: S_enc clamps to FLT_MAX and S_dec = 1 / FLT_MAX is a float32 subnormal, as
    # are some products of block scale and S_dec. The scale arithmetic is integer-built, so a
    # backend that flushes subnormals (XLA:CPU does) still gets the IEEE bits of the spec.
    x = np.asarray(spread_data(9, (32, 64), sigma=1.0), np.float32)
    x = (x / np.abs(x).max() * f32(1e-36)).astype(f32)
    x[np.abs(x) < np.finfo(np.float32).tiny] = 0.0  # inputs themselves normal (or zero)
    q = quantize_jit(jnp.asarray(x), two_d=two_d)
    codes, sbytes, amax, _ = ref_quantize(x, two_d=two_d)
    assert len(np.unique(sbytes)) > 4  # a real spread of scales, not one clamped value
    np.testing.assert_array_equal(unpack_codes(q), codes)
    np.testing.assert_array_equal(scale_bytes(q), sbytes)
    assert np.float32(q.amax) == amax
    # (Dequantized values here are float32 subnormals, amax / 2688 too: a flushing backend
    # returns zeros for them. That is the per-element exception documented in numerics.md.)


def test_subnormal_elements_on_a_flushing_backend():
    # The documented exception (docs/numerics.md): a backend that flushes float32 subnormals
    # reads subnormal *elements* as zero where they are scaled, x * enc_b; amax and the block
    # scales are computed on the bits and stay exact. It shows in blocks whose scale underflows
    # to 0 (enc_b = FLT_MAX: their values dequantize to 0 either way) and in tensors whose amax
    # is below ~2**-100. GPUs do not flush: there the plain spec holds (scripts/device_check.sh).
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((16, 64)) * 1e-38).astype(np.float32)  # many subnormals
    x[0, :16] = rng.standard_normal(16).astype(np.float32)  # normal blocks beside them
    assert (np.abs(x) < np.finfo(np.float32).tiny).mean() > 0.3
    q = quantize_jit(jnp.asarray(x))
    flushing = jax.jit(lambda v: v * np.float32(2.0**30))(np.float32(1e-40)) == 0
    if flushing:  # XLA:CPU
        codes, sbytes, amax, _ = ref_quantize(x, flush_elements=True)
        assert (codes != ref_quantize(x)[0]).any()  # the exception is real on this data
    else:
        codes, sbytes, amax, _ = ref_quantize(x)
    np.testing.assert_array_equal(unpack_codes(q), codes)
    np.testing.assert_array_equal(scale_bytes(q), sbytes)
    assert np.float32(q.amax) == amax


def test_block_axis_other_than_last():
    # Blocks along axis 0 of x are blocks along the last axis of x^T; codes packed along axis 0.
    x = spread_data(1, (64, 32))
    q = quantize_jit(x, axis=0)
    assert q.codes.shape == (32, 32) and q.scales.shape == (4, 32) and q.axis == 0
    qt = quantize_jit(x.T)
    np.testing.assert_array_equal(unpack_codes(q), np.asarray(unpack_codes(qt)).T)
    np.testing.assert_array_equal(scale_bytes(q), scale_bytes(qt).T)
    np.testing.assert_array_equal(dequantize_jit(q), np.asarray(dequantize_jit(qt)).T)
    # Rank 3, middle axis.
    x3 = jnp.moveaxis(spread_data(2, (32, 64)).reshape(4, 8, 64), 1, 2)
    q3 = quantize_jit(x3, axis=1)
    assert q3.codes.shape == (4, 32, 8) and q3.scales.shape == (4, 4, 8)
    ref = quantize_jit(jnp.moveaxis(x3, 1, 2).reshape(32, 64))
    np.testing.assert_array_equal(
        jnp.moveaxis(dequantize_jit(q3), 1, 2).reshape(32, 64), dequantize_jit(ref)
    )


# --- properties -------------------------------------------------------------------------------


def idempotence_data(seed, shape, dtype):
    """Ordinary data whose per-tensor amax survives dequantization exactly.

    Q(DQ(Q(x))) == Q(x) needs (a) every block scale to be a normal E4M3 number (in blocks with
    zero or subnormal scales the requantized block max can land on a different scale), and
    (b) 2688 * fl32(amax / 2688) == amax, which fails by one ulp for ~15% of amax values.
    Here amax = 2688 * 3 * 2**-12 exactly and the block magnitudes stay within e**+-2.
    """
    x = np.asarray(spread_data(seed, shape, sigma=0.5), np.float32)
    x = x / np.abs(x).max() * f32(0.9 * 2688 * 3 * 2.0**-12)
    x.flat[seed % x.size] = 2688 * 3 * 2.0**-12
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize(
    "kw,dtype,jit",
    [({}, jnp.float32, False), ({}, jnp.bfloat16, False)]
    + [(kw, dt, True) for kw in ({}, {"two_d": True}, {"axis": 0}) for dt in (jnp.float32, jnp.bfloat16)],
)
def test_idempotent(kw, dtype, jit):
    qf, dqf = (quantize_jit, dequantize_jit) if jit else (quantize_nvfp4, dequantize)
    for seed in range(3):
        x = idempotence_data(seed, (32, 64), dtype)
        q = qf(x, **kw)
        sb = scale_bytes(q)
        assert ((sb >= 0x08) | (sb == 0)).all()  # normal scales (or all-zero blocks), as intended
        q2 = qf(dqf(q), **kw)
        np.testing.assert_array_equal(q2.codes, q.codes)
        np.testing.assert_array_equal(scale_bytes(q2), scale_bytes(q))
        np.testing.assert_array_equal(q2.amax, q.amax)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("two_d", [False, True])
def test_error_bounds(dtype, two_d):
    x = spread_data(4, (32, 64), sigma=1.0, dtype=dtype)
    xf = np.asarray(x.astype(jnp.float32))
    q = quantize_jit(x, two_d=two_d)
    err = np.abs(np.asarray(dequantize(q)) - xf)
    # Per block: |x - x_hat| <= (largest half-step, 1 on the E2M1 grid) / enc_b, with
    # 1 / enc_b = s_b * S_dec ~ amax_b / 6 * (1 + 2**-4) for normal scales (here all of them).
    _, _, amax, s_b = ref_quantize(xf, two_d=two_d)
    bound = np.where(s_b >= 2.0**-6, s_b * (amax / f32(2688)) * f32(1.0001), np.inf)
    bound = np.repeat(np.repeat(bound, 16, 0), 16, 1) if two_d else np.repeat(bound, 16, 1)
    assert (err <= bound).all()
    # Whole tensor, plain Gaussian data: NVFP4 has ~9% (1x16) / ~10% (2D) relative RMS error.
    g = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32).astype(dtype)
    gf = np.asarray(g.astype(jnp.float32))
    rel = np.linalg.norm(np.asarray(dequantize(quantize_jit(g, two_d=two_d))) - gf) / np.linalg.norm(gf)
    assert 0.05 < rel < 0.12


def test_2d_values_transpose():
    # Every element of a tile shares one scale: quantized W^T == (quantized W)^T (FPROP/DGRAD).
    for seed in range(3):
        w = spread_data(seed, (64, 32), sigma=1.0)
        q, qt = quantize_jit(w, two_d=True), quantize_jit(w.T, two_d=True)
        np.testing.assert_array_equal(np.asarray(dequantize_jit(qt)), np.asarray(dequantize_jit(q)).T)
        np.testing.assert_array_equal(scale_bytes(qt), scale_bytes(q).T)


# --- the GEMM operand -------------------------------------------------------------------------

OPERAND_KW = [
    {},
    {"axis": 0},
    {"two_d": True},
    {"rht": True, "axis": 0},
    {"stochastic": True},
    {"rht": True, "axis": 0, "stochastic": True},
]


@pytest.mark.parametrize(
    "kw,dtype",
    [(kw, jnp.float32) for kw in OPERAND_KW] + [(OPERAND_KW[0], jnp.bfloat16), (OPERAND_KW[-1], jnp.bfloat16)],
    ids=lambda v: ("-".join(v) or "rn") if isinstance(v, dict) else jnp.dtype(v).name,
)
def test_operand_equals_dequantize(kw, dtype):
    kw = dict(kw)
    if kw.get("stochastic"):
        kw["key"] = jax.random.key(11)
    x = spread_data(5, (32, 64), dtype=dtype)
    # Eager mode compiles every op per shape and variant: run it for the 1x16 RN and SR forms.
    for jit in (False, True) if set(kw) <= {"stochastic", "key"} and dtype == jnp.float32 else (True,):
        q = (quantize_jit if jit else quantize_nvfp4)(x, **kw)
        values, dscale = (operand_jit if jit else nvfp4_gemm_operand)(x, **kw)
        assert values.dtype == jnp.bfloat16 and values.shape == x.shape
        assert dscale.dtype == jnp.float32 and dscale.shape == ()
        np.testing.assert_array_equal(values.astype(jnp.float32) * dscale, dequantize_jit(q))
        np.testing.assert_array_equal(dscale, np.float32(q.amax) / np.float32(2688))
        # values hold e2m1(code) * s_b exactly.
        lay_scales = np.asarray(q.scales.astype(jnp.float32))
        if kw.get("two_d"):
            s_b = np.repeat(np.repeat(lay_scales, 16, 0), 16, 1)
        elif kw.get("axis") == 0:
            s_b = np.repeat(lay_scales, 16, 0)
        else:
            s_b = np.repeat(lay_scales, 16, 1)
        e2m1 = np.array([*GRID, *-GRID], f32)[np.asarray(unpack_codes(q))]
        np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), e2m1 * s_b)


def test_operand_rht_is_in_rotated_domain():
    x = spread_data(6, (32, 64), sigma=1.0)
    v, d = operand_jit(x, rht=True, axis=0)
    v_ref, d_ref = operand_jit(jax.jit(random_hadamard_transform, static_argnums=1)(x, 0), axis=0)
    np.testing.assert_array_equal(v, v_ref)
    np.testing.assert_array_equal(d, d_ref)


# --- stochastic rounding statistics -----------------------------------------------------------


def test_sr_mean_matches_spec_expectation():
    # Fixed input with amax = 2688 (S_enc = S_dec = 1) and power-of-two block scales, so
    # y = x * enc_b is known exactly; expected value per spec: lo + step * floor(256 frac)/256.
    n_keys = 512
    rng = np.random.default_rng(0)
    y = rng.uniform(-6, 6, (16, 64)).astype(np.float32)
    y[:, ::16] = 6.0  # block amax 6 -> s_b = 1 exactly
    y[0, 0] = 2688.0  # the global amax (its own block, s_b = 448)
    x = jnp.asarray(y)
    keys = jax.random.split(jax.random.key(0), n_keys)
    vals = jax.jit(jax.vmap(lambda k: nvfp4_gemm_operand(x, stochastic=True, key=k)[0]))(keys)
    mean = np.asarray(vals.astype(jnp.float32)).mean(0)

    a = np.abs(y[:, 16:].astype(np.float64))
    step = np.where(a >= 4, 2.0, np.where(a >= 2, 1.0, 0.5))
    lo = np.floor(a / step) * step
    p_up = np.floor(256 * (a - lo) / step) / 256
    expect = np.sign(y[:, 16:]) * (lo + step * p_up)
    var = step**2 * p_up * (1 - p_up)
    # Each mean is over 512 independent draws: allow 5 standard errors (plus 1e-6).
    tol = 5 * np.sqrt(var / n_keys) + 1e-6
    assert (np.abs(mean[:, 16:] - expect) <= tol).all()
    # Mean absolute error of the SR average is below round-to-nearest's.
    rn = np.asarray(operand_jit(x)[0].astype(jnp.float32))[:, 16:]
    assert np.abs(mean[:, 16:] - y[:, 16:]).mean() < 0.5 * np.abs(rn - y[:, 16:]).mean()


def test_sr_on_grid_values_never_move():
    # Values exactly on the (scaled) grid: amax = 2688, block scales powers of two.
    grid = np.array([*GRID, *-GRID], np.float32)
    y = np.random.default_rng(1).choice(grid, (32, 64)).astype(np.float32)
    y[:, ::16] = 6.0
    y[1, 16:32] *= 0.25  # block amax 1.5 -> s_b = 0.25, values still on its grid
    y[0, :16] = 0.0
    y[0, 0] = 2688.0  # S_enc = 1; 2688 * enc_b = 6.0000005 clips to 6
    x = jnp.asarray(y)
    rn = quantize_jit(x)
    for i in range(8):
        sr = quantize_jit(x, stochastic=True, key=jax.random.key(i))
        np.testing.assert_array_equal(sr.codes, rn.codes)
        np.testing.assert_array_equal(scale_bytes(sr), scale_bytes(rn))


def test_sr_different_keys_differ():
    x = spread_data(8, (32, 64), sigma=1.0)
    a = quantize_jit(x, stochastic=True, key=jax.random.key(1))
    b = quantize_jit(x, stochastic=True, key=jax.random.key(2))
    a2 = quantize_jit(x, stochastic=True, key=jax.random.key(1))
    assert (np.asarray(a.codes) != np.asarray(b.codes)).mean() > 0.2
    np.testing.assert_array_equal(a.codes, a2.codes)
    # Scales and amax do not depend on the key (SR replaces step 5 only).
    np.testing.assert_array_equal(scale_bytes(a), scale_bytes(b))
    rn = quantize_jit(x)
    assert (np.asarray(a.codes) != np.asarray(rn.codes)).any()


# --- non-finite input -------------------------------------------------------------------------

NONFINITE_KW = [{}, {"two_d": True}, {"rht": True, "axis": 0}, {"stochastic": True}]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kw", NONFINITE_KW, ids=lambda kw: "-".join(kw) or "rn")
def test_nonfinite_gives_all_nan(bad, kw):
    kw = dict(kw)
    if kw.get("stochastic"):
        kw["key"] = jax.random.key(0)
    # A realistic size under jit (XLA's float max-reduction drops NaN on larger arrays) ...
    x = jax.random.normal(jax.random.key(1), (256, 1024), jnp.float32)
    for pos in [(0, 0), (255, 1023), (100, 517)]:
        xb = x.at[pos].set(bad)
        q = quantize_jit(xb, **kw)
        assert np.isnan(np.asarray(dequantize_jit(q))).all() and np.isnan(float(q.amax))
        # The stored block scales are NaN too, every one (not just the decoded values).
        assert np.isnan(np.asarray(q.scales.astype(jnp.float32))).all()
        v, d = operand_jit(xb, **kw)
        assert np.isnan(np.asarray(v.astype(jnp.float32))).all() and np.isnan(float(d))
    # ... and eagerly on the shape the other eager tests use (compile time: 1x16 RN only).
    if not kw:
        xb = spread_data(0, (32, 64)).at[5, 7].set(bad)
        assert np.isnan(np.asarray(dequantize(quantize_nvfp4(xb)))).all()
        assert np.isnan(np.asarray(nvfp4_gemm_operand(xb)[0].astype(jnp.float32))).all()


# --- pytree, jit, vmap, grad ------------------------------------------------------------------


def test_pytree_jit_vmap_grad():
    x = spread_data(9, (32, 64), sigma=1.0)
    q = quantize_nvfp4(x)
    leaves, tree = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 3
    q2 = jax.tree_util.tree_unflatten(tree, leaves)
    assert q2.shape == (32, 64) and q2.axis == 1 and not q2.two_d and not q2.rht
    # Returned from and passed into jit.
    qj = jax.jit(lambda a: quantize_nvfp4(a))(x)
    np.testing.assert_array_equal(dequantize_jit(qj), dequantize(q))
    # vmap: per-example tensors (each with its own amax).
    xs = jnp.stack([x, 3 * x, -x])
    dq = jax.jit(jax.vmap(lambda a: dequantize(quantize_nvfp4(a))))(xs)
    for i in range(3):
        np.testing.assert_array_equal(dq[i], dequantize_jit(quantize_jit(xs[i])))
    # As a residual of a custom VJP (straight-through estimator).

    @jax.custom_vjp
    def fake_quant(a):
        return dequantize(quantize_nvfp4(a))

    def fwd(a):
        q = quantize_nvfp4(a)
        return dequantize(q), q

    def bwd(q, g):
        return (g * (dequantize(q) != 0),)

    fake_quant.defvjp(fwd, bwd)
    g = jax.jit(jax.grad(lambda a: fake_quant(a).sum()))(x)
    assert g.shape == x.shape and set(np.unique(np.asarray(g)).tolist()) <= {0.0, 1.0}


def test_dequantize_dtype():
    x = spread_data(10, (32, 64), sigma=1.0)
    q = quantize_nvfp4(x)
    dq = dequantize(q, jnp.bfloat16)
    assert dq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(dq, dequantize(q).astype(jnp.bfloat16))


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [quantize_nvfp4, nvfp4_gemm_operand])
def test_errors(fn):
    x = jnp.zeros((32, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"block axis \(axis=1\) has length 40; it must be a multiple of 16"):
        fn(jnp.zeros((32, 40)))
    with pytest.raises(ValueError, match=r"axis=0\) has length 24"):
        fn(jnp.zeros((24, 32)), axis=0)
    with pytest.raises(ValueError, match=r"two_d=True needs both dims to be multiples of 16; got x.shape=\(24, 32\)"):
        fn(jnp.zeros((24, 32)), two_d=True)
    with pytest.raises(ValueError, match=r"two_d=True takes a 2-D weight; got x of rank 3"):
        fn(jnp.zeros((2, 32, 32)), two_d=True)
    with pytest.raises(ValueError, match=r"x has dtype int32; only real floating dtypes"):
        fn(jnp.zeros((32, 64), jnp.int32))
    with pytest.raises(ValueError, match=r"x has dtype complex64; only real floating dtypes"):
        fn(jnp.zeros((32, 64), jnp.complex64))
    with pytest.raises(ValueError, match=r"stochastic=True requires a PRNG key; got key=None"):
        fn(x, stochastic=True)
    with pytest.raises(ValueError, match=r"axis=2 is out of range for an array of rank 2"):
        fn(x, axis=2)
    with pytest.raises(ValueError, match=r"rht=True is not allowed with two_d=True"):
        fn(x, two_d=True, rht=True)
    with pytest.raises(ValueError, match=r"two_d=1 must be a Python bool"):
        fn(x, two_d=1)


def test_dequantize_rejects_unknown_type():
    with pytest.raises(ValueError, match=r"dequantize: q has type ndarray; expected one of NVFP4Tensor"):
        dequantize(np.zeros(3))


# --- per-tensor factors shared by the operands of one GEMM pass -------------------------------


# Amaxes at every edge of the factors' arithmetic: zero, subnormal, the smallest normal, values
# whose S_enc or table entries are subnormal or overflow, the largest finite, Inf and NaN.
EDGE_AMAXES = np.array(
    [0.0, 1e-45, 3e-42, 2.0**-126, 1e-30, 1e-12, 0.1, 1.0, 3.0, 2688.0, 1e12, 1e30, 3e38,
     np.finfo(np.float32).max, np.inf, np.nan],
    np.float32,
)


@pytest.mark.parametrize("jit", [False, True])
def test_tensor_factors_of_a_vector_equal_each_amax_on_its_own(jit):
    """`tensor_factors` of a vector of amaxes is, field by field and bit for bit, the factors
    of each amax computed alone (what `quantize_blocks_group` relies on)."""
    from nvfp4_jax.quant import nvfp4

    fn = jax.jit(nvfp4.tensor_factors) if jit else nvfp4.tensor_factors
    together = fn(jnp.asarray(EDGE_AMAXES))
    assert together.table.shape == (len(EDGE_AMAXES), 128, 2)
    for i, amax in enumerate(EDGE_AMAXES):
        alone = fn(jnp.float32(amax))
        for name, got, want in zip(alone._fields, together.at(i), alone):
            np.testing.assert_array_equal(
                np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32), err_msg=f"{name}, amax={amax}")


def test_tensor_factors_equal_ieee_float32_arithmetic():
    """The per-tensor factors against the spec's four float32 operations done one after the other
    by numpy (IEEE, subnormals kept), bit for bit, at every edge of the arithmetic and at random
    amaxes, under IEEE and under GPU-legal arithmetic."""
    from nvfp4_jax.quant import nvfp4

    rng = np.random.default_rng(5)
    raw = rng.integers(0, 2**31, 2000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    amax = np.concatenate([EDGE_AMAXES, raw, np.abs(rng.standard_normal(500).astype(np.float32))])
    f32, fmax = np.float32, np.finfo(np.float32).max
    values = np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(all="ignore"):
        s_enc = np.where(np.isinf(amax), f32(1.0), np.minimum(f32(2688.0) / amax, fmax))
        s_dec = f32(1.0) / s_enc
        enc = np.minimum(f32(1.0) / (values[None, :] * s_dec[:, None]), fmax)
        want = dict(mult=s_enc * (f32(1.0) / f32(6.0)), decode=amax / f32(2688.0), enc=enc)
    got = jax.jit(nvfp4.tensor_factors)(jnp.asarray(amax))
    for name, g in (("mult", got.mult), ("decode", got.decode), ("enc", got.table[..., 1])):
        g, w = np.asarray(g, np.float32), want[name].astype(np.float32)
        same = (g.view(np.uint32) == w.view(np.uint32)) | (np.isnan(g) & np.isnan(w))
        assert same.all(), f"{name}: {np.count_nonzero(~same)} differ, first at amax={amax[np.argwhere(~same)[0][0]]!r}"
    np.testing.assert_array_equal(np.asarray(got.table[..., 0]), np.broadcast_to(values, enc.shape))


def test_operand_group_equals_each_operand_on_its_own():
    """`gemm_operand_group` (one `tensor_factors` for all its operands) returns bit for bit what
    `gemm_operand` gives each operand alone, for every kind of operand one GEMM pass has, on
    tensors whose amaxes are far apart (one of them not finite), and the spec transcription's
    codes for one of them."""
    from nvfp4_jax.quant import nvfp4
    from nvfp4_jax.quant.spec import OperandSpec

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((64, 32)) * 1e-20, jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 48)) * 3e3, jnp.float32)
    g = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    bad = g.at[3, 5].set(jnp.inf)
    k1, k2 = jax.random.split(jax.random.key(3))
    items = [
        (x, OperandSpec(axis=1), None),
        (w, OperandSpec(two_d=True), None),
        (g, OperandSpec(axis=1, stochastic=True), k1),
        (g, OperandSpec(axis=0, rht=True, stochastic=True), k2),
        (x, OperandSpec(axis=0, rht=True), None),
        (bad, OperandSpec(axis=1), None),
    ]
    together = jax.jit(lambda xs, ks: nvfp4.gemm_operand_group(
        [(a, s, k) for a, (_, s, _), k in zip(xs, items, ks)]))([a for a, _, _ in items], [k for _, _, k in items])
    for (a, spec, key), (values, decode) in zip(items, together):
        want_values, want_decode = jax.jit(lambda a, k, spec=spec: nvfp4.gemm_operand(a, spec, k))(a, key)
        assert_same = np.testing.assert_array_equal
        assert_same(np.asarray(values).view(np.uint16), np.asarray(want_values).view(np.uint16), err_msg=str(spec))
        assert_same(np.asarray(decode).view(np.uint32), np.asarray(want_decode).view(np.uint32), err_msg=str(spec))
    blocks = nvfp4.quantize_blocks_group([(x, items[0][1], None), (w, items[1][1], None)])
    codes, sbytes, amax, _ = ref_quantize(np.asarray(w), two_d=True)
    np.testing.assert_array_equal(np.asarray(blocks[1].codes).reshape(w.shape), codes)
    np.testing.assert_array_equal(np.asarray(lax.bitcast_convert_type(blocks[1].scales, jnp.uint8)), sbytes)
    assert np.float32(blocks[1].amax) == amax
