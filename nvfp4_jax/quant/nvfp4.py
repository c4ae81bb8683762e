"""NVFP4 quantization: the bit-exact reference of Transformer Engine 2.14+ (docs/numerics.md).

One implementation of the math, the block quantizer `quantize_blocks(x, spec, key)`, serves
every form: `gemm_operand` / `nvfp4_gemm_operand` (unpacked bf16 values, what the emulated GEMM
consumes), `quantize_nvfp4` (packed E2M1 codes + E4M3 scales + amax, the storage form), the xla
backend's operands, the Pallas kernels' per-tensor factors and the health statistics.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import block_tensor, exact
from . import formats as F
from .hadamard import random_hadamard_transform
from .spec import OperandSpec


@block_tensor.register
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor(block_tensor.BlockScaledTensor):
    """An NVFP4-quantized tensor (`block_tensor.BlockScaledTensor`): 1x16 blocks or 16x16 tiles,
    float8_e4m3fn block scales, and `amax`, the float32 per-tensor amax the scales were
    encoded with (after the RHT when `rht`; NaN when the input was not finite)."""

    BLOCK: ClassVar[int] = F.NVFP4_BLOCK

    def scale_blocks(self, values_blocked, scales_keepdims):
        # spec section 3, in this order: e2m1_value(code) * float(s_b) * (amax / 2688)
        return (values_blocked * F.fp8_to_f32(scales_keepdims)) * decode_scale(self.amax)


# --- argument checks --------------------------------------------------------------------------


def check_operand(x, spec: OperandSpec, key, fn: str) -> OperandSpec:
    """Validate `x` and `spec` for the NVFP4 block quantizer; return the spec with its block
    axis normalized (non-negative; the last axis for 2D tiles)."""
    return F.check_spec(x, spec, key, F.NVFP4_BLOCK, fn)


def _layout(shape, axis, two_d) -> F.BlockLayout:
    return F.block_layout(shape, axis, F.NVFP4_BLOCK, two_d)


# --- the math (spec sections 2, 4, 6, 8) ------------------------------------------------------
#
# Every value that decides a bit is computed so that no backend can change it: the per-tensor and
# per-block factors with integer-built, correctly rounded arithmetic (`exact`), E4M3 rounding on
# the bits, and the per-element work as one float32 multiply (correctly rounded everywhere) and
# integer rounding. See docs/numerics.md, "Same bits on every backend".

# The E2M1 code of every element of a non-finite tensor (its block scales are all NaN).
NONFINITE_CODE = np.uint32(0)
_ONE_SIXTH = np.float32(1.0) / np.float32(6.0)  # fl32(1/6), folded into the global multiplier
# float32 value of every non-negative E4M3 byte 0x00..0x7F (0x7F is NaN): the block scales.
_E4M3_VALUES = np.arange(128, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)


def decode_scale(amax: jax.Array) -> jax.Array:
    """The per-tensor decode factor amax / 2688, correctly rounded on every backend."""
    return exact.div(amax, F.NVFP4_GLOBAL_SCALE)


def _tiny_multiplier(mult: jax.Array) -> jax.Array:
    """`mult * 2**-149` where that matters to `block_scales`, exactly, in normal float32 steps.

    A subnormal block amax is frac * 2**-149 (frac < 2**23), scaled as frac * (mult * 2**-149).
    For mult >= 2**23 the factor is a normal number: the exponent field lowered by 149, on the
    bits (no float product for XLA to fold into one by a subnormal constant). For smaller mult, frac * mult * 2**-149 < 2**-103, far below half the smallest
    E4M3 scale (2**-10): the block scale is 0 whatever the factor, so it is 0 (no subnormal
    factor for a flushing backend to read differently).
    """
    scaled = exact.from_bits(exact.bits(mult) - np.uint32(149 << 23))
    return jnp.where(mult >= np.float32(2.0**23), scaled, jnp.float32(0.0))


class TensorFactors(NamedTuple):
    """The per-tensor factors of one amax, or of a vector of them (`tensor_factors`): each
    field has the amaxes' shape in front."""

    mult: jax.Array  # fl32(S_enc * fl32(1/6)): block scales are amax_b * mult
    mult_tiny: jax.Array  # mult * 2**-149 where it matters, for subnormal block amaxes (`block_scales`)
    table: jax.Array  # [..., 128, 2]: (s_b, enc_b) per non-negative E4M3 byte
    decode: jax.Array  # S_dec of the GEMM: fl32(amax / 2688)

    def at(self, i: int) -> "TensorFactors":
        """The factors of the `i`-th amax of a vector."""
        return TensorFactors(*(field[i] for field in self))


def tensor_factors(amax: jax.Array) -> TensorFactors:
    """Per-tensor factors of `amax` (spec section 2): the block-scale multiplier, the
    block-factor table and the decode scale. `amax` is a float32 scalar, or a vector of the
    amaxes of several tensors, which then share one computation (`quantize_blocks_group`).

    S_enc = min(2688 / amax, FLT_MAX) (1 when amax is Inf) and S_dec = 1 / S_enc. The table has
    a row per non-negative E4M3 byte: its scale s_b and the encode factor
    enc = min(1 / (s_b * S_dec), FLT_MAX), so blocks look both up by their scale's byte instead
    of dividing. Correctly rounded on every backend (`exact` where hardware arithmetic may not
    be). Three exact divisions and one exact product in all, the two that need only amax in one
    call; each result leaves through `computed_once`, so XLA computes it once, not once per
    consumer (the table in the shape the blocks' gather reads).
    """
    amax = jnp.asarray(amax, jnp.float32)
    scale = jnp.full_like(amax, F.NVFP4_GLOBAL_SCALE)
    (quotients,) = F.computed_once(exact.div(jnp.stack([scale, amax]), jnp.stack([amax, scale])))
    s_enc = jnp.where(jnp.isinf(amax), jnp.float32(1.0), jnp.minimum(quotients[0], jnp.float32(F.FLT_MAX)))
    (s_dec,) = F.computed_once(exact.div(1.0, s_enc))
    # S_enc is a normal number (at least 2688 / FLT_MAX) or NaN, and so is its product with
    # fl32(1/6): a float32 multiply of normals with a normal result is correctly rounded on
    # every IEEE backend. The other factors can be subnormal: `exact` rounds them.
    mult = s_enc * _ONE_SIXTH
    values = jnp.broadcast_to(_E4M3_VALUES, amax.shape + _E4M3_VALUES.shape)
    enc = jnp.minimum(exact.div(1.0, exact.mul(values, s_dec[..., None])), jnp.float32(F.FLT_MAX))
    scalars, table = F.computed_once(jnp.stack([mult, _tiny_multiplier(mult), quotients[1]]),
                                     jnp.stack([values, enc], axis=-1))
    return TensorFactors(scalars[0], scalars[1], table, scalars[2])


def block_scales(amax_b: jax.Array, mult: jax.Array, mult_tiny: jax.Array) -> jax.Array:
    """Block scales e4m3(clip(min(amax_b * mult, FLT_MAX), 0, 448)), mult = fl32(S_enc / 6).

    amax_b * mult of two normal floats is correctly rounded on every backend. A subnormal
    amax_b (which a flush-to-zero backend reads as 0) is frac * 2**-149, so its product is
    frac * (mult * 2**-149) = frac * mult_tiny, rounded once. A subnormal product is below the
    smallest E4M3 scale and rounds to 0 either way.
    """
    amax_bits = exact.bits(amax_b)
    frac = (amax_bits & np.uint32(0x7FFFFF)).astype(jnp.float32)  # exact: below 2**23
    product = jnp.where(amax_bits >= np.uint32(0x00800000), amax_b * mult, frac * mult_tiny)
    return F.round_to_e4m3(jnp.clip(jnp.minimum(product, F.FLT_MAX), 0.0, F.E4M3_MAX))


@dataclasses.dataclass(frozen=True)
class BlockCodes:
    """What the block quantizer computes, in the blocked layout of `lay` (not a pytree: it lives
    inside one trace).

    codes: uint32 0..15 E2M1 codes, `lay.blocked`. s_b: float32 block scales, `lay.keepdims`
    (NaN everywhere when x is not finite). scales: the same as float8_e4m3fn, `lay.scale_shape`.
    amax: the float32 per-tensor amax (after the RHT; NaN when x is not finite). lay: the layout.
    decode: the per-tensor decode factor amax / 2688 (`decode_scale`, from `tensor_factors`).
    """

    codes: jax.Array
    s_b: jax.Array
    scales: jax.Array
    amax: jax.Array
    lay: F.BlockLayout
    decode: jax.Array


class Blocks(NamedTuple):
    """An operand seen as scaling blocks, with its amaxes: the block quantizer's first half
    (`operand_blocks`), all that the per-tensor factors need."""

    xb: jax.Array  # float32 values in the blocked layout `lay.blocked` (rotated when spec.rht)
    amax_b_bits: jax.Array  # per-block amax bits, `lay.keepdims`
    amax: jax.Array  # the float32 tensor amax; NaN when x is not finite
    nonfinite: jax.Array  # bool scalar
    lay: F.BlockLayout
    spec: OperandSpec  # checked, its block axis normalized
    shape: tuple  # the operand's logical shape


def operand_blocks(x: jax.Array, spec: OperandSpec, key=None, *, fn: str = "quantize_blocks") -> Blocks:
    """Check `x` and `spec` (`check_operand`), take the RHT when `spec.rht` (the amax is the
    rotated tensor's), and view the values as blocks with their amaxes."""
    spec = check_operand(x, spec, key, fn)
    if spec.rht:
        x = random_hadamard_transform(x, spec.axis)  # amax is taken after the transform
    lay = _layout(x.shape, spec.axis, spec.two_d)
    xb = x.astype(jnp.float32).reshape(lay.blocked)
    # Integer max over |x| bits: exact, and NaN/Inf cannot be dropped.
    amax_b_bits, amax_bits = F.block_amax_bits(xb, lay)
    nonfinite = F.is_nonfinite_bits(amax_bits)
    amax = jnp.where(nonfinite, jnp.float32(jnp.nan), F.bits_to_f32(amax_bits))
    return Blocks(xb, amax_b_bits, amax, nonfinite, lay, spec, tuple(x.shape))


def encode_blocks(blocks: Blocks, factors: TensorFactors, key=None, rbits=None) -> BlockCodes:
    """The block quantizer's second half: E4M3 block scales and E2M1 codes of `blocks`, given
    the per-tensor factors of its amax; a stochastic spec rounds with `key`'s noise, or with
    `rbits` when given (`stochastic_rounding_bits(key, shape)`, drawn by the caller)."""
    lay, nonfinite = blocks.lay, blocks.nonfinite
    scale_bytes = lax.bitcast_convert_type(
        block_scales(F.bits_to_f32(blocks.amax_b_bits), factors.mult, factors.mult_tiny), jnp.uint8
    )
    # A non-finite tensor gets the NaN scale (byte 0x7F) in every block.
    index = jnp.where(nonfinite, np.int32(0x7F), scale_bytes.astype(jnp.int32))
    # A gather by the scale's byte gives each block its (s_b, enc_b); XLA computes it once per
    # block (a cheap expression would be fused into the element loop and redone 16x). The
    # stored scales are read back from it too (s_b is an E4M3 value: the cast is exact), so
    # that the scale computation is not repeated for them either.
    per_block = factors.table.at[index].get(mode="promise_in_bounds")
    s_b, enc_b = per_block[..., 0], per_block[..., 1]
    scales = s_b.astype(jnp.float8_e4m3fn)

    y = jnp.clip(blocks.xb * enc_b, -F.E2M1_MAX, F.E2M1_MAX)
    if blocks.spec.stochastic:
        if rbits is None:
            rbits = F.stochastic_rounding_bits(key, blocks.shape)
        rbits = rbits.reshape(lay.blocked)
        codes = F.e2m1_codes(F.round_e2m1_stochastic(y, rbits))
    else:
        codes = F.e2m1_rn_codes(y)
    # A non-finite tensor's codes are all 0 (+0), whatever NaN a backend's arithmetic made of
    # its elements: the NaN scales alone say "not finite" (E2M1 has no NaN).
    codes = jnp.where(nonfinite, NONFINITE_CODE, codes)
    return BlockCodes(codes, s_b, scales.reshape(lay.scale_shape), blocks.amax, lay, factors.decode)


def quantize_blocks(x: jax.Array, spec: OperandSpec, key=None, *, fn: str = "quantize_blocks") -> BlockCodes:
    """The NVFP4 block quantizer: E2M1 codes and E4M3 block scales of `x` as `spec` says.

    Checks `x` and `spec` (`check_operand`) and takes the RHT first when `spec.rht` (the
    amax is the rotated tensor's). Every public NVFP4 form is built from its result.
    """
    blocks = operand_blocks(x, spec, key, fn=fn)
    return encode_blocks(blocks, tensor_factors(blocks.amax), key)


def quantize_blocks_group(items, *, fn: str = "quantize_blocks_group") -> list[BlockCodes]:
    """`[quantize_blocks(x, spec, key) for x, spec, key in items]`, bit for bit, with the
    per-tensor factors of all the operands computed together (one `tensor_factors` of their
    amaxes): the operands one GEMM pass quantizes, so that the integer-built factors appear
    once per pass in the program rather than once per operand (XLA's compile time grows with
    the size of the program)."""
    blocks = [operand_blocks(x, spec, key, fn=fn) for x, spec, key in items]
    if len(blocks) == 1:
        return [encode_blocks(blocks[0], tensor_factors(blocks[0].amax), items[0][2])]
    factors = tensor_factors(jnp.stack([b.amax for b in blocks]))
    # The stochastic operands' noise from one threefry call (the same bytes as one call each).
    rounded = [i for i, b in enumerate(blocks) if b.spec.stochastic]
    noise = dict(zip(rounded, F.stochastic_rounding_bits_group(
        [items[i][2] for i in rounded], [blocks[i].shape for i in rounded]))) if rounded else {}
    return [encode_blocks(b, factors.at(i), key, noise.get(i))
            for i, (b, (_, _, key)) in enumerate(zip(blocks, items))]


def _values(q: BlockCodes, shape):
    return (F.e2m1_values(q.codes) * q.s_b).astype(jnp.bfloat16).reshape(shape)  # exact: 2 x 4 significant bits


def gemm_operand(x: jax.Array, spec: OperandSpec, key=None, *, fn: str = "gemm_operand"):
    """The emulated GEMM's operand of `x` as `spec` says: `(bf16 values, fp32 decode scale)`
    (see `nvfp4_gemm_operand`). The reference operand quantizer of the NVFP4 backends."""
    q = quantize_blocks(x, spec, key, fn=fn)
    return _values(q, x.shape), q.decode


def gemm_operand_group(items, *, fn: str = "gemm_operand_group"):
    """`[gemm_operand(x, spec, key) for x, spec, key in items]`, bit for bit, the per-tensor
    factors computed together (`quantize_blocks_group`): an `NVFP4Backend`'s `operand_group`."""
    xs, specs, keys = zip(*items)
    return _gemm_operand_group(list(xs), list(keys), specs=tuple(specs), fn=fn)


@functools.partial(jax.jit, static_argnames=("specs", "fn"))
def _gemm_operand_group(xs, keys, *, specs, fn):
    items = list(zip(xs, specs, keys))
    return [(_values(q, x.shape), q.decode)
            for q, (x, _, _) in zip(quantize_blocks_group(items, fn=fn), items)]


# --- the keyword forms -----------------------------------------------------------------------


def nvfp4_gemm_operand(x: jax.Array, *, key: jax.Array | None = None, **spec_fields) -> tuple[jax.Array, jax.Array]:
    """NVFP4-quantize `x` into the unpacked form an emulated GEMM consumes (`gemm_operand`),
    the spec given as `OperandSpec`'s keywords (`axis=-1, two_d, rht, stochastic`).

    Returns `(values, decode_scale)`: `values` has x's shape (rotated when `rht`), bfloat16,
    equal exactly to `e2m1_value(code) * scale_b`; `decode_scale` is the float32 scalar
    `amax / 2688`. Bitwise, `values.astype(f32) * decode_scale ==
    dequantize(quantize_nvfp4(x, same args))`. Non-finite input gives NaN values.
    """
    return gemm_operand(x, OperandSpec(**spec_fields), key, fn="nvfp4_gemm_operand")


def quantize_nvfp4(x: jax.Array, *, key: jax.Array | None = None, **spec_fields) -> NVFP4Tensor:
    """Quantize `x` to NVFP4 exactly as Transformer Engine 2.14+ does (the storage form).

    x: float32 or bfloat16, any rank. The spec as `OperandSpec`'s keywords:
    axis (-1): blocks of 16 run along it (1x16 scaling).
    two_d: 16x16 tiles of a 2-D weight (axis is ignored; codes packed along the last axis).
    rht: apply the 16-point Random Hadamard Transform along `axis` first (WGRAD operands);
        the result stays in the rotated domain and `amax` is taken after the transform.
    stochastic: 8-bit stochastic rounding (spec section 6) with the PRNG `key` (required).
    A tensor containing NaN or Inf quantizes to one that dequantizes to all NaN.
    Raises ValueError on bad shapes, dtypes or argument combinations.
    """
    spec = OperandSpec(**spec_fields)
    return pack(x.shape, quantize_blocks(x, spec, key, fn="quantize_nvfp4"), spec)


def pack(shape, q: BlockCodes, spec: OperandSpec) -> NVFP4Tensor:
    """The storage form (`NVFP4Tensor`) of the block quantizer's result for `spec`."""
    return NVFP4Tensor.from_codes(q.codes.reshape(shape), q.scales, spec, amax=q.amax)


def unpack_codes(q: NVFP4Tensor) -> jax.Array:
    """The E2M1 codes (uint8, 0..15) of `q` in its logical shape."""
    return q.unpack_codes()
