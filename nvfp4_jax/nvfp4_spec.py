"""The numerical contract (docs/numerics.md) transcribed into numpy, and the test data that stresses it.

Written from the spec, independently of `nvfp4_jax.quant`: numpy's float32 is IEEE 754 with
correctly rounded division and no flushing of subnormals, so it is the reference every backend
must match. Shared by the quantizer and kernel tests and the device checks
(`nvfp4_jax.device_check`); not used by the package's numerics.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

f32 = np.float32
FLT_MAX = np.finfo(np.float32).max
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# E2M1 rounding ties (midpoints of the grid), where a 1-ulp error in y = x * enc_b flips a code.
TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)


# --- the spec -----------------------------------------------------------------------------------


def ref_e2m1_codes(y: np.ndarray) -> np.ndarray:
    """Round-to-nearest on the E2M1 grid in float64, ties to the even code; sign kept."""
    a = np.abs(y.astype(np.float64))[..., None]
    d = np.abs(a - GRID)
    dmin = d.min(-1, keepdims=True)
    cand = np.where(d == dmin, np.arange(8), 99)
    even = np.where(cand % 2 == 0, cand, 99).min(-1)
    idx = np.where((d == dmin).sum(-1) > 1, even, cand.min(-1))
    return (idx | np.where(np.signbit(y), 8, 0)).astype(np.uint8)


def ref_sr_codes(y: np.ndarray, rbits: np.ndarray) -> np.ndarray:
    """Spec section 6 literally, in float32."""
    a = np.abs(y).astype(f32)
    step = np.where(a >= 4, f32(2), np.where(a >= 2, f32(1), f32(0.5)))
    t = (a + (rbits.astype(f32) / f32(256)) * step).astype(f32)
    step_t = np.where(t >= 4, f32(2), np.where(t >= 2, f32(1), f32(0.5)))
    q = np.minimum(np.floor(t / step_t) * step_t, f32(6))
    return ref_e2m1_codes(np.copysign(q, y))


def ref_quantize(x, *, two_d=False, rbits=None, flush_elements=False):
    """Spec section 2 (and 4, 6) on a 2-D float32 array, blocks along the last axis.

    `flush_elements`: read float32-subnormal elements as (signed) zero where each element is
    scaled (x * enc_b), as a flush-to-zero backend does; amax and block scales stay exact.
    Returns (codes uint8 unpacked, scale bytes, amax, block scale as float32).
    """
    x = np.asarray(x, np.float32)
    x_scaled = _flush(x) if flush_elements else x
    m, n = x.shape
    ax = np.abs(x)
    amax = ax.max()
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = np.minimum(f32(2688) / amax, FLT_MAX).astype(f32)
        s_dec = f32(1) / s_enc
        if two_d:
            amax_b = ax.reshape(m // 16, 16, n // 16, 16).max((1, 3))
            expand = lambda s: np.repeat(np.repeat(s, 16, 0), 16, 1)  # noqa: E731
        else:
            amax_b = ax.reshape(m, n // 16, 16).max(-1)
            expand = lambda s: np.repeat(s, 16, 1)  # noqa: E731
        mult = f32(s_enc * (f32(1) / f32(6)))
        s = np.clip(np.minimum(amax_b * mult, FLT_MAX), 0, 448).astype(f32)
        s8 = s.astype(ml_dtypes.float8_e4m3fn)
        s_b = s8.astype(f32)
        enc = np.minimum(f32(1) / (s_b * s_dec), FLT_MAX).astype(f32)
        y = np.clip(x_scaled * expand(enc), -6, 6).astype(f32)
    codes = ref_e2m1_codes(y) if rbits is None else ref_sr_codes(y, rbits)
    return codes, s8.view(np.uint8), amax, s_b


def ref_dequantize(codes, scale_bytes, amax, two_d=False):
    vals = np.array([*GRID, *-GRID], f32)[codes]
    s_b = scale_bytes.view(ml_dtypes.float8_e4m3fn).astype(f32)
    s_b = np.repeat(np.repeat(s_b, 16, 0), 16, 1) if two_d else np.repeat(s_b, 16, 1)
    return (vals * s_b) * (f32(amax) / f32(2688))


def _flush(v: np.ndarray) -> np.ndarray:
    return np.where(np.abs(v) < np.finfo(np.float32).tiny, np.copysign(f32(0), v), v).astype(f32)


def ref_rht_last_axis(x: np.ndarray) -> np.ndarray:
    """Spec section 5 with the package's fixed summation order (docs/numerics.md): bf16 input,
    exact products with +-1/4, the Walsh-Hadamard butterfly in float32 (pairs at strides 1, 2,
    4, 8; sum to the lower index, difference to the upper), rounded to bf16."""
    v = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    v = (v.reshape(-1, 16) * (RHT_SIGNS / f32(4))).astype(np.float32)
    for h in (1, 2, 4, 8):
        v = v.reshape(-1, 16 // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        v = np.stack([a + b, a - b], axis=2).astype(np.float32)
    return v.reshape(np.shape(x)).astype(ml_dtypes.bfloat16)


# --- data ---------------------------------------------------------------------------------------


def spread_data(seed, shape, sigma=3.0, dtype=jnp.float32):
    """Gaussian values times a log-normal per-16-block magnitude (wide dynamic range: zero,
    subnormal and underflowing block scales), with a few all-zero blocks."""
    rng = np.random.default_rng(seed)
    m, n = shape
    mag = np.exp(sigma * rng.standard_normal((m, n // 16, 1)))
    mag[rng.random(mag.shape) < 0.05] = 0.0
    x = (rng.standard_normal((m, n // 16, 16)) * mag).reshape(m, n).astype(np.float32)
    return jnp.asarray(x, dtype)


def tie_rich_data(seed, shape, *, two_d=False, k=-3):
    """bfloat16-representable data on which most products x * enc_b land within one float32
    ulp of an E2M1 rounding tie: what a 1-ulp error in any scale factor flips.

    The tensor amax is 2688 * 2**k, so S_enc = 2**-k and S_dec = 2**k exactly. Each block (or
    16x16 tile) gets an E4M3 scale s_b = c * 2**f with c in 1..15 (normal and subnormal E4M3),
    through a block maximum of 6 * s_b * 2**k; then enc_b = fl32(1 / c) * 2**(-f - k), and the
    other elements are +-tie * c * 2**(f + k), whose products with enc_b are tie * c * fl32(1/c):
    the tie itself, or one ulp off it. A few elements per block are plain random values.
    Returns float32 numpy data (every value exact in bfloat16).
    """
    rng = np.random.default_rng(seed)
    m, n = shape
    bm, bn = (m // 16, n // 16)
    nblocks = bm * bn if two_d else m * bn
    c = rng.integers(1, 16, nblocks)
    f = np.where(c >= 8, rng.integers(-9, 5, nblocks), -9)  # E4M3: c < 8 only as subnormals
    unit = (c * 2.0 ** (f + k)).astype(np.float64)[:, None]  # s_b * S_dec
    ties = rng.choice(np.concatenate([TIES, -TIES]), (nblocks, 256 if two_d else 16))
    blocks = ties * unit
    noise = rng.random(blocks.shape) < 0.1
    blocks[noise] = (rng.uniform(-5.5, 5.5, noise.sum()) * np.broadcast_to(unit, blocks.shape)[noise])
    blocks[:, 0] = 6 * unit[:, 0] * rng.choice([-1, 1], nblocks)  # the block maximum
    blocks = blocks.astype(ml_dtypes.bfloat16).astype(np.float32)
    if two_d:
        x = blocks.reshape(bm, bn, 16, 16).transpose(0, 2, 1, 3).reshape(m, n)
    else:
        x = blocks.reshape(m, n)
    x.flat[rng.integers(0, x.size // 16) * 16] = 2688 * 2.0**k  # the tensor amax (its block: c=14, f=5)
    return x
