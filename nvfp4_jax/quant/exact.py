"""Correctly rounded float32 arithmetic built from integer operations: the same bits on every backend.

A backend may compute float32 division only faithfully (XLA:GPU's `div.full.f32` is off by up to
2 ulp), contract a multiply and an add into an FMA, or flush subnormal operands and results to
zero (XLA:CPU does). None of that reaches the functions here: they unpack float32 bits into
integer significands and exponents, do the arithmetic on uint32, and round once, to nearest
even, with subnormal results and overflow to infinity exactly as IEEE 754 prescribes.

They are meant for the quantizers' scale factors (scalars, or a handful of values per tensor).
Each is one or two hundred element-wise ops after XLA's simplification (about 170 instructions
for `div`), with short dependency chains and no loops (a 27-step long division, unrolled,
followed by a `min` did not compile in minutes on XLA >= 0.11). `div` and `mul` are jitted so
that eager callers run them as one compiled computation rather than op by op.

Representation used throughout: a finite non-zero magnitude is `sig * 2**(exp - 23)` with
`sig` in [2**23, 2**24) (uint32) and `exp` its unbiased exponent (int32), subnormals included.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_QNAN = np.uint32(0x7FC00000)
_HIDDEN = np.uint32(0x00800000)
_FRAC = np.uint32(0x007FFFFF)


def bits(x) -> jax.Array:
    """The uint32 bit pattern of float32 `x`."""
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)


def from_bits(b) -> jax.Array:
    """The float32 whose bit pattern is uint32 `b`."""
    return lax.bitcast_convert_type(jnp.asarray(b, jnp.uint32), jnp.float32)


def unpack(mag: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(sig, exp)` of finite non-zero magnitudes given as uint32 bits (subnormals normalized)."""
    field = (mag >> 23).astype(jnp.int32)
    frac = mag & _FRAC
    normal = field > 0
    # A subnormal's fraction has at least 9 leading zeros; shift its top bit to position 23.
    shift = lax.clz(frac).astype(jnp.int32) - 8
    sig = jnp.where(normal, frac | _HIDDEN, frac << jnp.clip(shift, 0, 31).astype(jnp.uint32))
    exp = jnp.where(normal, field - 127, -126 - shift)
    return sig, exp


def round_pack(sig: jax.Array, exp: jax.Array, sticky: jax.Array) -> jax.Array:
    """Magnitude bits of `sig * 2**exp` rounded to float32, to nearest even.

    `sig` is a uint32 below 2**31, `exp` int32; `sticky` says the exact value lies strictly above
    `sig * 2**exp` (bits were lost below it). Subnormal results and overflow to Inf are exact.
    """
    n = 32 - lax.clz(sig).astype(jnp.int32)  # bit length of sig (0 for sig == 0)
    lead = exp + n - 1  # exponent of the leading bit
    normal = lead >= -126
    drop = jnp.where(normal, n - 24, -149 - exp)  # low bits of sig below the result's ulp
    left = jnp.clip(-drop, 0, 31).astype(jnp.uint32)
    right = jnp.clip(drop, 0, 31).astype(jnp.uint32)
    kept = jnp.where(drop <= 0, sig << left, sig >> right)
    rem = sig & ((np.uint32(1) << right) - np.uint32(1))
    half = jnp.where(drop > 0, np.uint32(1) << jnp.clip(drop - 1, 0, 31).astype(jnp.uint32), 0)
    up = (drop > 0) & ((rem > half) | ((rem == half) & (sticky | ((kept & 1) == 1))))
    kept = jnp.where(drop >= 32, np.uint32(0), kept + up.astype(jnp.uint32))
    # A normal result's kept includes the hidden bit: adding it to (biased exponent - 1) << 23
    # gives the right bits, and a rounding carry to 2**24 bumps the exponent by itself.
    base = jnp.clip(lead + 126, 0, 254).astype(jnp.uint32) << 23
    out = jnp.where(normal, base + kept, kept)
    overflow = (lead > 127) | (out >= _INF)
    return jnp.where(sig == 0, np.uint32(0), jnp.where(overflow, _INF, out))


class _Side(NamedTuple):
    """One float32 operand taken apart: its sign bit, its classes, and the significand and
    exponent of its magnitude (`sig = 2**23, exp = 0` for zero, Inf and NaN, so that no
    estimate below divides by zero)."""

    sign: jax.Array
    nan: jax.Array
    inf: jax.Array
    zero: jax.Array
    sig: jax.Array
    exp: jax.Array


def _side(x) -> _Side:
    b = bits(x)
    mag = b & _ABS
    zero = mag == 0
    sig, exp = unpack(mag)
    special = (mag >= _INF) | zero
    return _Side(b & _SIGN, mag > _INF, mag == _INF, zero,
                 jnp.where(special, _HIDDEN, sig), jnp.where(special, 0, exp))


_ONE = np.uint32(0x3F800000)  # the bits of 1.0f
_QUOTIENT_BITS = 25  # the quotient's significand is floor(sa * 2**25 / sb): 25 or 26 bits


def _remainder(num: jax.Array, q: jax.Array, sb: jax.Array) -> jax.Array:
    """`num - q * sb` as int32, computed modulo 2**32: exact whenever the true value is below
    2**31 in magnitude, whatever the sizes of the terms (uint32 arithmetic wraps)."""
    return lax.bitcast_convert_type(num - q * sb, jnp.int32)


def _quotient(a: _Side, b: _Side):
    """`(q, exp, sticky)`: a / b is `q * 2**exp`, plus something below it when `sticky` (see `div`)."""
    # Estimate: both significands as floats in [1, 2), so the quotient is a normal number on
    # every backend, flush-to-zero included; the float -> uint32 conversion truncates (q > 0).
    ma, mb = from_bits((a.sig & _FRAC) | _ONE), from_bits((b.sig & _FRAC) | _ONE)
    q = (ma / mb * np.float32(2.0**_QUOTIENT_BITS)).astype(jnp.uint32)
    num = a.sig << np.uint32(_QUOTIENT_BITS)  # the low 32 bits of sa * 2**25 are all we need
    r = _remainder(num, q, b.sig)
    step = jnp.floor(r.astype(jnp.float32) / b.sig.astype(jnp.float32)).astype(jnp.int32)
    q = q + lax.bitcast_convert_type(step, jnp.uint32)
    r = _remainder(num, q, b.sig)
    sb = b.sig.astype(jnp.int32)
    low, high = r < 0, r >= sb
    q = q - low.astype(jnp.uint32) + high.astype(jnp.uint32)
    r = r + jnp.where(low, sb, 0) - jnp.where(high, sb, 0)
    return q, a.exp - b.exp - _QUOTIENT_BITS, r != 0


def _product(a: _Side, b: _Side):
    """`(top, exp, sticky)` of a * b: the 48-bit product of the significands from 12-bit limbs,
    its top bits (p >> 20) and whether any below them are set."""
    m12 = np.uint32(0xFFF)
    ah, al, bh, bl = a.sig >> 12, a.sig & m12, b.sig >> 12, b.sig & m12
    lo = al * bl
    mid = ah * bl + al * bh + (lo >> 12)
    top = ah * bh * np.uint32(16) + (mid >> 8)
    return top, a.exp + b.exp - 26, ((mid & np.uint32(0xFF)) != 0) | ((lo & m12) != 0)


def _finish(a: _Side, b: _Side, mag, nan, inf, zero) -> jax.Array:
    """The float32 result: `mag` (rounded magnitude bits) unless a special case decides it."""
    mag = jnp.where(inf, _INF, jnp.where(zero, np.uint32(0), mag))
    return from_bits(jnp.where(nan, _QNAN, mag | (a.sign ^ b.sign)))


@jax.jit
def div(a, b) -> jax.Array:
    """`a / b` in float32, correctly rounded (IEEE 754, round to nearest even).

    The significands' quotient `q = floor(sa * 2**25 / sb)` (25 or 26 bits) is estimated with
    one hardware division of the significands scaled to [1, 2), which need only be accurate to
    about 2**-18 (a faithful GPU division is 2**-22), then made exact with integer remainders:
    `r = sa * 2**25 - q * sb` is small, so it is exact modulo 2**32; one step moves q by
    floor(r / sb) (within one of the truth), one more by the sign of r and r - sb. `round_pack`
    then rounds `q` (plus a sticky bit for r != 0) once, at whatever the result's exponent is.
    No long dependency chain: XLA compiles it in milliseconds.
    """
    a, b = _side(a), _side(b)
    nan = a.nan | b.nan | (a.inf & b.inf) | (a.zero & b.zero)
    return _finish(a, b, round_pack(*_quotient(a, b)), nan, a.inf | b.zero, a.zero | b.inf)


@jax.jit
def mul(a, b) -> jax.Array:
    """`a * b` in float32, correctly rounded, subnormal operands and results included."""
    a, b = _side(a), _side(b)
    nan = a.nan | b.nan | (a.inf & b.zero) | (a.zero & b.inf)
    return _finish(a, b, round_pack(*_product(a, b)), nan, a.inf | b.inf, a.zero | b.zero)


def round_to_grid(x, mantissa_bits: int, min_exp: int) -> jax.Array:
    """Round float32 values to the grid of a narrower float format, to nearest even, in float32.

    The format keeps `mantissa_bits` fraction bits for exponents >= `min_exp` (its smallest
    normal exponent) and below that is subnormal, with the fixed spacing
    2**(min_exp - mantissa_bits) (which must be at least 2**-126). No range limit: saturate
    before or after as the format needs. NaN stays NaN, Inf stays Inf. This is what a float8
    cast does, done so that no backend's cast (a hardware instruction, or a software one
    through float16 with double rounding) can change it: normal values round on their bits;
    subnormal ones by adding 2**23 to |x| / spacing, an exact product, so that one IEEE add
    rounds it to an integer (also if a backend fuses the two into an FMA).
    """
    xb = bits(x)
    mag = xb & _ABS
    drop = 23 - mantissa_bits
    lsb = (mag >> drop) & np.uint32(1)
    half = np.uint32((1 << (drop - 1)) - 1)
    normal = (mag + half + lsb) & ~np.uint32((1 << drop) - 1)
    spacing = float(2.0 ** (min_exp - mantissa_bits))
    t = from_bits(mag) * np.float32(1.0 / spacing) + np.float32(2.0**23)
    # Constants' bits from numpy: Pallas's Triton lowering cannot bitcast a literal.
    count = (bits(t) - np.float32(2.0**23).view(np.uint32)).astype(jnp.float32)  # exact: < 2**mantissa_bits
    sub = bits(count * np.float32(spacing))
    out = jnp.where(mag >= np.float32(2.0**min_exp).view(np.uint32), normal, sub)
    out = jnp.where(mag >= _INF, mag, out)
    return from_bits(out | (xb & _SIGN))
