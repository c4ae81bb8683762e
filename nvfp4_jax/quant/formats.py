"""Low-precision formats: E2M1 (FP4), E4M3/E5M2 (FP8), E8M0, and nibble packing.

Everything here is integer work on float32 bits, or float work whose result is exact (products
by powers of two, comparisons), so that no backend can change its meaning: not XLA rewriting
under `jit`, not a GPU's approximate division or FMA contraction (see docs/numerics.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nvfp4_jax.quant import exact

# --- constants --------------------------------------------------------------------------------

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FLT_MAX = float(np.finfo(np.float32).max)
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
# S_enc = NVFP4_GLOBAL_SCALE / amax: the largest block scale times the largest FP4 value.
NVFP4_GLOBAL_SCALE = E2M1_MAX * E4M3_MAX  # 2688
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127

# The 16 E2M1 code points: 0x0..0x7 positive, 0x8..0xF the same negated (0x8 is -0).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

_ABS_MASK = np.uint32(0x7FFFFFFF)
_F32_INF_BITS = np.uint32(0x7F800000)


def _u32(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def _f32(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


# --- amax on the bits ------------------------------------------------------------------------


def abs_bits(x: jax.Array) -> jax.Array:
    """|x| of a float32 array as uint32 bits.

    For non-negative floats the bit pattern orders like the value, and NaN > Inf > any finite
    value, so an integer max over these bits is an amax that never drops NaN (XLA's float
    max-reduction can).
    """
    return _u32(x.astype(jnp.float32)) & _ABS_MASK


def is_nonfinite_bits(amax_bits: jax.Array) -> jax.Array:
    """True where `abs_bits` values are Inf or NaN."""
    return amax_bits >= _F32_INF_BITS


def bits_to_f32(bits: jax.Array) -> jax.Array:
    return _f32(bits)


# --- E4M3 / E5M2 ------------------------------------------------------------------------------


# (mantissa bits, smallest normal exponent) of each float8 format: its rounding grid.
_FP8_GRIDS = {jnp.dtype(jnp.float8_e4m3fn): (3, -6), jnp.dtype(jnp.float8_e5m2): (2, -14)}


def saturating_cast(v: jax.Array, dtype) -> jax.Array:
    """Round float32 to a float8 dtype (RNE), saturating at its max finite value; NaN stays NaN.

    The rounding is done on the bits (`exact.round_to_grid`), so the value handed to the cast
    is already on the float8 grid and every backend's cast (a hardware instruction, or XLA's
    software conversion, possibly through float16) is exact. XLA's and ml_dtypes' own float8
    casts do not saturate (E4M3: >= 464 becomes NaN), hence the clip.
    """
    dtype = jnp.dtype(dtype)
    fmax = float(jnp.finfo(dtype).max)
    v = jnp.clip(v.astype(jnp.float32), -fmax, fmax)
    return exact.round_to_grid(v, *_FP8_GRIDS[dtype]).astype(dtype)


def round_to_e4m3(v: jax.Array) -> jax.Array:
    """float32 -> float8_e4m3fn, RNE, saturating at +-448 (see `saturating_cast`)."""
    return saturating_cast(v, jnp.float8_e4m3fn)


def fp8_to_f32(v: jax.Array) -> jax.Array:
    return v.astype(jnp.float32)


# --- E2M1 -------------------------------------------------------------------------------------


def e2m1_rn_codes(y: jax.Array) -> jax.Array:
    """E2M1 codes (uint32, 0..15) of float32 values in [-6, 6], round-to-nearest-even.

    Ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. Integer work
    on the float32 bits (several times faster on CPU than XLA's float4 cast, same result):
    for |y| >= 1, adding 0x1FFFFF plus the kept bit rounds the significand to one bit (RNE),
    the carry running into the exponent (1.75 -> 2), and bits >> 22 is then 2 * exp + mantissa
    (1.0 -> 254). Below 1 the codes are 0 (0), 1 (0.5), 2 (1.0). The sign is kept, so a
    negative value that rounds to zero gives code 0x8 (-0), as a float4 cast does.
    """
    bits = _u32(y)
    mag = bits & _ABS_MASK
    lsb = (mag >> 22) & np.uint32(1)
    normal = ((mag + np.uint32(0x1FFFFF) + lsb) >> 22) - np.uint32(252)
    a = _f32(mag)
    sub = (a > 0.25).astype(jnp.uint32) + (a >= 0.75).astype(jnp.uint32)
    idx = jnp.where(mag >= np.uint32(0x3F800000), normal, sub)
    return idx | ((bits >> 28) & np.uint32(8))


# --- stochastic-rounding noise ---------------------------------------------------------------
#
# One definition of the noise, used by the jnp quantizer and inside the Pallas kernels: a
# counter-based function of (key, flat element index), written in plain uint32 operations that
# any backend (XLA, Triton) runs alike. `jax.random.bits` cannot serve inside a kernel: its
# mapping from counters to outputs depends on the `jax_threefry_partitionable` flag.

_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = np.uint32(0x1BD11BDA)
SR_GROUP = 8  # elements per threefry call: 2 words of 4 bytes
_MAX_SR_GROUPS = 2**32


def threefry2x32(k0, k1, x0, x1) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 block cipher with 20 rounds (Salmon et al., SC'11), on uint32 arrays.

    The generator behind `jax.random`: `(y0, y1)` equals `jax.extend.random.threefry_2x32((k0,
    k1), concatenate([x0, x1]))` split in halves. Only adds, shifts, ors and xors, so that it
    runs inside a Pallas kernel.
    """
    def rotl(v, r):
        return (v << np.uint32(r)) | (v >> np.uint32(32 - r))

    ks = (k0, k1, k0 ^ k1 ^ _THREEFRY_PARITY)
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def sr_key_words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The two uint32 words that key the noise: a threefry key's own data (typed or raw).

    A key of another PRNG implementation is first hashed to two words with `jax.random.bits`.
    """
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(key)
        if data.shape != (2,):
            data = jax.random.bits(key, (2,), jnp.uint32)
    else:
        data = jnp.asarray(key)
    if data.shape != (2,) or data.dtype != jnp.uint32:
        raise ValueError(
            f"stochastic rounding needs one PRNG key (a jax.random.key, or uint32[2]); got an "
            f"array of shape {data.shape} and dtype {data.dtype}"
        )
    return data[0], data[1]


def sr_noise_groups(k0, k1, groups: jax.Array) -> jax.Array:
    """Noise bytes (uint32 0..255) of `groups` (uint32 group indices), shape `groups.shape + (8,)`.

    Group g covers flat elements 8g..8g+7: element 8g + e gets byte e % 4 (the low byte first)
    of word e // 4 of `threefry2x32(k0, k1, g, 0)`. A broadcast and a select rather than a
    stack or a bitcast: XLA:CPU runs it fastest, and a Triton kernel can lower it.
    """
    with jax.named_scope("threefry_sr_noise"):  # benchmarks/bench_step.py's category
        y0, y1 = threefry2x32(k0, k1, groups, jnp.zeros_like(groups))
        e = jnp.arange(SR_GROUP, dtype=jnp.uint32)
        word = jnp.where(e < 4, y0[..., None], y1[..., None])
        return (word >> ((e & np.uint32(3)) << np.uint32(3))) & np.uint32(0xFF)


def _sr_counters(shape: tuple[int, ...]) -> tuple[int, int]:
    """(elements, threefry counters) of a tensor of `shape`; ValueError past the 32-bit counter."""
    n = math.prod(shape)
    groups = -(-n // SR_GROUP)
    if groups > _MAX_SR_GROUPS:
        raise ValueError(
            f"shape={shape}: stochastic rounding numbers elements with 32-bit counters of "
            f"{SR_GROUP}; at most {SR_GROUP * _MAX_SR_GROUPS} elements, got {n}"
        )
    return n, groups


def stochastic_rounding_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint8 noise of `shape`: 8 random bits per element, as Blackwell's SR uses.

    Element i of the row-major flattened shape gets byte i % 8 of threefry2x32 of the counter
    i // 8 (`sr_noise_groups`): a function of the key and the element's index only, so a
    kernel that quantizes any tile of the tensor draws the same byte for it.
    """
    n, groups = _sr_counters(shape)
    k0, k1 = sr_key_words(key)
    noise = sr_noise_groups(k0, k1, jnp.arange(groups, dtype=jnp.uint32)).reshape(-1)
    return noise[:n].astype(jnp.uint8).reshape(shape)


def stochastic_rounding_bits_group(keys, shapes) -> list[jax.Array]:
    """`[stochastic_rounding_bits(key, shape) for key, shape in zip(keys, shapes)]`, bit for
    bit, from one threefry call over all the tensors' counters, each with its own key words:
    the cipher appears once in the program rather than once per tensor."""
    if len(keys) == 1:
        return [stochastic_rounding_bits(keys[0], shapes[0])]
    sizes, groups = zip(*(_sr_counters(shape) for shape in shapes))
    words = [sr_key_words(key) for key in keys]
    counters = jnp.concatenate([jnp.arange(g, dtype=jnp.uint32) for g in groups])
    # Which tensor each counter belongs to, as a select on the position (fused, not stored).
    position = jnp.arange(sum(groups), dtype=jnp.int32)
    k0, k1 = words[-1]
    start = sum(groups[:-1])
    for (w0, w1), g in zip(reversed(words[:-1]), reversed(groups[:-1])):
        start -= g
        below = position < start + g
        k0, k1 = jnp.where(below, w0, k0), jnp.where(below, w1, k1)
    noise = sr_noise_groups(k0, k1, counters).reshape(-1)
    out, offset = [], 0
    for shape, n, g in zip(shapes, sizes, groups):
        out.append(noise[offset:offset + n].astype(jnp.uint8).reshape(shape))
        offset += g * SR_GROUP
    return out


def round_e2m1_stochastic(y: jax.Array, rbits: jax.Array) -> jax.Array:
    """Hardware-style stochastic rounding of float32 values in [-6, 6] onto the E2M1 grid.

    Returns the rounded float32 values (signed; use `e2m1_codes` for the codes).

    `rbits` is uint8 noise of `y`'s shape (8 random bits per element, as on Blackwell).
    Spec section 6: t = |y| + u * step(|y|), then round t down on the grid at t.
    P(round up) = floor(256 * frac) / 256; values on the grid never move. Every operation is
    exact or rounds once (u * step is exact, so an FMA gives the same t), and the division by
    the power-of-two step is a multiplication by its reciprocal: no backend can change a bit.
    """
    a = jnp.abs(y)
    step = jnp.where(a >= 4.0, 2.0, jnp.where(a >= 2.0, 1.0, 0.5)).astype(jnp.float32)
    u = rbits.astype(jnp.float32) * np.float32(1.0 / 256.0)
    t = a + u * step
    step_t = jnp.where(t >= 4.0, 2.0, jnp.where(t >= 2.0, 1.0, 0.5)).astype(jnp.float32)
    inv_step_t = jnp.where(t >= 4.0, 0.5, jnp.where(t >= 2.0, 1.0, 2.0)).astype(jnp.float32)
    q = jnp.minimum(jnp.floor(t * inv_step_t) * step_t, E2M1_MAX)
    return jnp.copysign(q, y)


def e2m1_codes(q: jax.Array) -> jax.Array:
    """E2M1 codes (uint32, 0..15) of float32 values already on the E2M1 grid (signed, -0 ok).

    Bit arithmetic instead of a float4 cast: for |q| >= 1 the float32 exponent and top mantissa
    bit are the code's exponent and mantissa (bits >> 22 is 2 * biased_exp + m, 1.0 -> 254);
    0.5 (code 1) and 0 (code 0) are the two subnormal codes.
    """
    bits = _u32(q)
    mag = bits & _ABS_MASK
    normal = (mag >> 22).astype(jnp.int32) - 252  # 1.0 -> 2, ..., 6.0 -> 7
    sub = (mag != 0).astype(jnp.int32)  # 0.5 -> 1, 0 -> 0
    idx = jnp.where(mag >= np.uint32(0x3F800000), normal, sub)
    return idx.astype(jnp.uint32) | ((bits >> 28) & np.uint32(8))


def e2m1_values(codes: jax.Array) -> jax.Array:
    """Float32 values of E2M1 codes (unsigned ints, 0..15; higher bits ignored)."""
    c = codes.astype(jnp.uint32)
    idx = c & np.uint32(7)
    # idx >= 2: exponent (idx >> 1) - 1, mantissa idx & 1; idx 1 is 0.5 and idx 0 is 0.
    normal = (((idx >> 1) + np.uint32(126)) << 23) | ((idx & np.uint32(1)) << 22)
    mag = jnp.where(idx >= 2, normal, idx * np.uint32(0x3F000000))
    return _f32(mag | ((c & np.uint32(8)) << 28))


# --- nibble packing ---------------------------------------------------------------------------


def _pair_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + (shape[axis] // 2, 2) + shape[axis + 1 :]


def pack_nibbles(codes: jax.Array, axis: int = -1) -> jax.Array:
    """Pack codes (unsigned ints, 0..15) two per byte along `axis`: element 2i in the low nibble.

    Along the last axis the pairs are bitcast to uint16 (little-endian: the even element is the
    low byte), which XLA CPU vectorizes; strided even/odd slices are several times slower.
    """
    axis = axis % codes.ndim
    if codes.shape[axis] % 2:
        raise ValueError(
            f"pack_nibbles: axis {axis} has odd length {codes.shape[axis]}; it must be even"
        )
    pairs = codes.astype(jnp.uint8).reshape(_pair_shape(codes.shape, axis))
    if axis == codes.ndim - 1:
        w = lax.bitcast_convert_type(pairs, jnp.uint16)
        return ((w & np.uint16(0xF)) | ((w >> 4) & np.uint16(0xF0))).astype(jnp.uint8)
    lo = lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
    hi = lax.index_in_dim(pairs, 1, axis + 1, keepdims=False)
    return (lo & np.uint8(0xF)) | (hi << np.uint8(4))


def unpack_nibbles(packed: jax.Array, axis: int = -1) -> jax.Array:
    """Inverse of `pack_nibbles`: the length along `axis` doubles."""
    axis = axis % packed.ndim
    lo = packed & np.uint8(0xF)
    hi = packed >> np.uint8(4)
    pairs = jnp.stack([lo, hi], axis=axis + 1)
    shape = packed.shape[:axis] + (packed.shape[axis] * 2,) + packed.shape[axis + 1 :]
    return pairs.reshape(shape)


# --- E8M0 -------------------------------------------------------------------------------------


def e8m0_from_exponent(e: jax.Array) -> jax.Array:
    """float8_e8m0fnu holding 2**e for integer e in [-127, 127]."""
    return lax.bitcast_convert_type((e + E8M0_BIAS).astype(jnp.uint8), jnp.float8_e8m0fnu)


def e8m0_exponent(s: jax.Array) -> jax.Array:
    """Unbiased exponent (int32) of a float8_e8m0fnu array; NaN (0xFF) gives 128."""
    return lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.int32) - E8M0_BIAS


def pow2(e: jax.Array) -> jax.Array:
    """2.0**e as float32 for integer e in [-126, 127], built from bits (exact)."""
    return _f32(((e + 127).astype(jnp.uint32)) << 23)


def mul_pow2(x: jax.Array, e: jax.Array) -> jax.Array:
    """x * 2**e for integer e in [-254, 254], without a subnormal factor (XLA CPU flushes those).

    Two normal power-of-two factors; exact unless the result itself is subnormal or overflows.
    """
    e1 = e // 2
    return x * pow2(e1) * pow2(e - e1)


# --- argument checks and block layout shared by the quantizers --------------------------------


def check_float(x: jax.Array, fn: str) -> None:
    dt = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"{fn}: x has dtype {dt}; only real floating dtypes are allowed (float32 or bfloat16)"
        )


def normalize_axis(axis, ndim: int, fn: str) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise ValueError(f"{fn}: axis={axis!r} must be a Python int")
    if ndim == 0 or not -ndim <= axis < ndim:
        raise ValueError(f"{fn}: axis={axis} is out of range for an array of rank {ndim}")
    return int(axis) % ndim


def check_block_axis(shape: tuple[int, ...], axis: int, block: int, fn: str) -> None:
    if shape[axis] % block:
        raise ValueError(
            f"{fn}: the block axis (axis={axis}) has length {shape[axis]}; it must be a "
            f"multiple of {block} (x.shape={tuple(shape)})"
        )


def check_spec(x: jax.Array, spec, key, block: int, fn: str):
    """Validate `x` and an `OperandSpec` for a block quantizer with `block`-element blocks (and
    `block` x `block` tiles); return the spec with its block axis normalized (non-negative; the
    last axis for 2-D tiles). NVFP4 and MXFP4 accept the same combinations."""
    check_float(x, fn)
    for name in ("two_d", "rht", "stochastic"):
        v = getattr(spec, name)
        if not isinstance(v, bool):
            raise ValueError(f"{fn}: {name}={v!r} must be a Python bool (it is static)")
    if spec.stochastic and key is None:
        raise ValueError(f"{fn}: stochastic=True requires a PRNG key; got key=None")
    if spec.two_d:
        if x.ndim != 2:
            raise ValueError(
                f"{fn}: two_d=True takes a 2-D weight; got x of rank {x.ndim} (shape {x.shape})"
            )
        if spec.rht:
            raise ValueError(f"{fn}: rht=True is not allowed with two_d=True (2D is for weights)")
        if x.shape[0] % block or x.shape[1] % block:
            raise ValueError(
                f"{fn}: two_d=True needs both dims to be multiples of {block}; "
                f"got x.shape={x.shape}"
            )
        return dataclasses.replace(spec, axis=1)
    axis = normalize_axis(spec.axis, x.ndim, fn)
    check_block_axis(x.shape, axis, block, fn)
    return dataclasses.replace(spec, axis=axis)


class BlockLayout(NamedTuple):
    """How a tensor is viewed as scaling blocks: reshape to `blocked`, reduce `reduce_axes`.

    No transposes: a block axis in the middle becomes (pre, n_blocks, block, post).
    """

    blocked: tuple[int, ...]
    reduce_axes: tuple[int, ...]
    scale_shape: tuple[int, ...]

    @property
    def keepdims(self) -> tuple[int, ...]:
        """`blocked` with the reduced axes set to 1 (block scales broadcast from here)."""
        return tuple(1 if i in self.reduce_axes else d for i, d in enumerate(self.blocked))


def block_layout(shape: tuple[int, ...], axis: int, block: int, two_d: bool = False) -> BlockLayout:
    """1 x `block` blocks along `axis`, or `block` x `block` tiles of a 2-D array."""
    if two_d:
        m, n = shape
        return BlockLayout((m // block, block, n // block, block), (1, 3), (m // block, n // block))
    pre = int(np.prod(shape[:axis], dtype=np.int64))
    post = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    nb = shape[axis] // block
    # A trailing unit dim would only get in XLA's way: keep the common axis=-1 case 3-D.
    blocked = (pre, nb, block) + ((post,) if post > 1 else ())
    return BlockLayout(blocked, (2,), tuple(shape[:axis]) + (nb,) + tuple(shape[axis + 1 :]))


def computed_once(*values: jax.Array) -> tuple[jax.Array, ...]:
    """The float32 arrays `values`, unchanged, computed once each rather than once per use.

    XLA CPU fuses cheap work on a few values into the loops that broadcast them, and so redoes
    it for every block or element: the integer-built per-tensor factors (`exact`, hundreds of
    ops) would run once per block, 10**5 times over. An optimization barrier does not survive
    to XLA's fusion pass; a sort does (it is never fused), so each value goes through a sort
    of two copies of its bits. Use it for per-tensor values only: it costs a small sort.
    """
    return tuple(_f32(lax.sort(jnp.stack([_u32(v), _u32(v)]), dimension=0)[0]) for v in values)


def block_amax_bits(xb: jax.Array, lay: BlockLayout) -> tuple[jax.Array, jax.Array]:
    """(per-block amax bits in `lay.keepdims`, tensor amax bits) of a blocked float32 array.

    XLA CPU vectorizes a 16-wide reduction along the minor axis poorly: taking the max of the
    two halves elementwise first runs ~2x faster (XLA merges a reduce-of-a-reduce back into
    one, but not this). The barrier makes the tensor amax a max over the small block-amax
    array: without it XLA rewrote max(max_block(x)) into a reduce-window over a materialized
    copy of |x|.
    """
    bits = abs_bits(xb)
    if lay.reduce_axes[-1] == bits.ndim - 1:
        halves = bits.reshape(bits.shape[:-1] + (2, bits.shape[-1] // 2))
        bits = jnp.maximum(halves[..., 0, :], halves[..., 1, :])
    amax_b_bits = lax.optimization_barrier(jnp.max(bits, axis=lay.reduce_axes, keepdims=True))
    return amax_b_bits, jnp.max(amax_b_bits)
