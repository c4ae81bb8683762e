"""MXFP4: E2M1 elements in blocks of 32 with power-of-two E8M0 scales (spec section 10).

TE `pow_2_scales`, JAX's MX path and torchao's RCEIL mode: scale = 2**clamp(ceil(log2(
amax_b / 6)), -127, 127), code = e2m1(clip(x / scale, -6, 6)); no per-tensor scale.

The block quantizer also takes the NVFP4 recipe's operand handling (`OperandSpec`), so that a
recipe can change the format alone: 32x32 tiles of a 2-D weight (one scale per tile, from the
tile's amax: the quantized W and W^T hold the same numbers), the 16-point Random Hadamard
Transform along the block axis before the amax (a block of 32 spans two Hadamard groups), and
the NVFP4 path's hardware-style stochastic rounding (the same noise bytes and rule).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from . import block_tensor, exact
from . import formats as F
from .hadamard import random_hadamard_transform
from .spec import OperandSpec


@block_tensor.register
@dataclasses.dataclass(frozen=True)
class MXFP4Tensor(block_tensor.BlockScaledTensor):
    """An MXFP4-quantized tensor (`block_tensor.BlockScaledTensor`): 1x32 blocks or 32x32
    tiles, float8_e8m0fnu block scales (NaN when the input was not finite), no per-tensor
    amax."""

    BLOCK: ClassVar[int] = F.MXFP4_BLOCK

    def scale_blocks(self, values_blocked, scales_keepdims):
        # e2m1_value(code) * 2**e, exact; NaN where the scale is NaN
        e = F.e8m0_exponent(scales_keepdims)
        return jnp.where(e > F.E8M0_MAX_EXP, jnp.float32(jnp.nan), F.mul_pow2(values_blocked, jnp.minimum(e, 127)))


def _scale_exponent(amax_b_bits: jax.Array) -> jax.Array:
    """clamp(ceil(log2(amax_b / 6)), -127, 127) from the bits of finite amax_b, exactly.

    With amax_b = m * 2**p, m in [1, 2): amax_b / 6 = (m / 1.5) * 2**(p - 2) and m / 1.5 lies in
    [2/3, 4/3), so the exponent is p - 2, plus 1 when m > 1.5. No division, so no backend's
    rounding of amax_b / 6 enters; TE's correctly rounded quotient never crosses a power of two
    that the exact one does not (and below 2**-126 the clamp hides any difference).
    """
    sig, p = exact.unpack(amax_b_bits)
    e = p - 2 + (sig > np.uint32(3 << 22)).astype(jnp.int32)
    return jnp.where(amax_b_bits == 0, F.E8M0_MIN_EXP, jnp.clip(e, F.E8M0_MIN_EXP, F.E8M0_MAX_EXP))


def quantize_mxfp4(x: jax.Array, *, key: jax.Array | None = None, **spec_fields) -> MXFP4Tensor:
    """Quantize `x` (float32/bfloat16, any rank) to MXFP4, the spec as `OperandSpec`'s keywords:

    axis (-1): 32-element blocks along it. two_d: 32x32 tiles of a 2-D weight, one scale per
    tile (axis is ignored; codes packed along the last axis). rht: the 16-point Random Hadamard
    Transform along `axis` first (the WGRAD copies); the result stays in the rotated domain.
    stochastic: the NVFP4 path's 8-bit stochastic rounding with the PRNG `key` (required), else
    round to nearest even. Non-finite input gives NaN scales everywhere (dequantizes to all NaN).
    """
    return quantize_mxfp4_spec(x, OperandSpec(**spec_fields), key, fn="quantize_mxfp4")


def quantize_mxfp4_spec(
    x: jax.Array, spec: OperandSpec, key=None, *, fn: str = "quantize_mxfp4_spec"
) -> MXFP4Tensor:
    """The MXFP4 block quantizer: `x` quantized as `spec` says (the form the quantized dot and
    the health statistics call, so that both see one quantization)."""
    spec = F.check_spec(x, spec, key, F.MXFP4_BLOCK, fn)
    if spec.rht:
        x = random_hadamard_transform(x, spec.axis)  # the amax is the rotated tensor's
    lay = F.block_layout(x.shape, spec.axis, F.MXFP4_BLOCK, spec.two_d)
    xb = x.astype(jnp.float32).reshape(lay.blocked)

    amax_b_bits, amax_bits = F.block_amax_bits(xb, lay)
    e = _scale_exponent(amax_b_bits)
    y = jnp.clip(F.mul_pow2(xb, -e), -F.E2M1_MAX, F.E2M1_MAX)  # x / 2**e, exact
    if spec.stochastic:
        # The noise of element i is a function of the key and i (row-major) alone, whatever
        # the layout: the same bytes an NVFP4 operand of this shape draws.
        rbits = F.stochastic_rounding_bits(key, x.shape).reshape(lay.blocked)
        codes = F.e2m1_codes(F.round_e2m1_stochastic(y, rbits))
    else:
        codes = F.e2m1_rn_codes(y)
    scales = F.e8m0_from_exponent(e)
    nan = jax.lax.bitcast_convert_type(np.uint8(0xFF), jnp.float8_e8m0fnu)
    scales = jnp.where(F.is_nonfinite_bits(amax_bits), nan, scales)
    return MXFP4Tensor.from_codes(codes.reshape(x.shape), scales.reshape(lay.scale_shape), spec)


def dequantize_mxfp4(q: MXFP4Tensor, dtype=jnp.float32) -> jax.Array:
    """e2m1_value(code) * 2**e; NaN where the scale is NaN (in the rotated domain when `q.rht`)."""
    return q.dequantize(dtype)
