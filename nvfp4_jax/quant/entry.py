"""The one quantize entry point: a tensor and its operand spec in, the chosen form out.

    quantize(x, OperandSpec(axis=1, rht=True), key, format="nvfp4", form="storage")

`format`: `nvfp4` (1x16 blocks or 16x16 tiles, E4M3 block scales, an fp32 tensor amax) or
`mxfp4` (1x32 / 32x32, E8M0 power-of-two scales). `form`: what the caller consumes:
- `storage`: the packed tensor (`block_tensor.BlockScaledTensor`: `NVFP4Tensor`, `MXFP4Tensor`),
  what a checkpoint or a network payload holds;
- `operand`: `(bf16 values, fp32 decode scale)`, what the emulated GEMM consumes (NVFP4);
- `block_scaled`: `xla_backend.BlockScaledOperand`, `jax.nn.scaled_matmul`'s operand (NVFP4).
Every form of a format comes from the same block quantizer, so they hold the same numbers:
`dequantize(quantize(x, s))` equals `values * decode` of the operand form, bit for bit.
The keyword forms (`quantize_nvfp4`, `quantize_mxfp4`, `nvfp4_gemm_operand`, `xla_operand`)
take the spec's fields as keywords; the quantized dot and the backends call the spec forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import mxfp4, nvfp4, xla_backend
from .block_tensor import BlockScaledTensor
from .fp8 import FP8Tensor
from .spec import OperandSpec

FORMATS = ("nvfp4", "mxfp4")
FORMS = ("storage", "operand", "block_scaled")

_QUANTIZERS = {
    ("nvfp4", "storage"): lambda x, spec, key, fn: nvfp4.pack(x.shape, nvfp4.quantize_blocks(x, spec, key, fn=fn), spec),
    ("nvfp4", "operand"): lambda x, spec, key, fn: nvfp4.gemm_operand(x, spec, key, fn=fn),
    ("nvfp4", "block_scaled"): lambda x, spec, key, fn: xla_backend.block_scaled_operand(x, spec, key, fn=fn),
    ("mxfp4", "storage"): lambda x, spec, key, fn: mxfp4.quantize_mxfp4_spec(x, spec, key, fn=fn),
}


def quantize(x: jax.Array, spec: OperandSpec = OperandSpec(), key: jax.Array | None = None, *,
             format: str = "nvfp4", form: str = "storage", fn: str = "quantize"):
    """`x` (float32 or bfloat16) quantized as `spec` says, in `format`, as `form` (see the
    module's docstring). `key`: the PRNG key of stochastic rounding (required when
    `spec.stochastic`). Raises ValueError naming a bad format, form, shape or argument."""
    if format not in FORMATS:
        raise ValueError(f"{fn}: format={format!r} is not allowed: one of {', '.join(FORMATS)}")
    if form not in FORMS:
        raise ValueError(f"{fn}: form={form!r} is not allowed: one of {', '.join(FORMS)}")
    quantizer = _QUANTIZERS.get((format, form))
    if quantizer is None:
        allowed = ", ".join(f for (fmt, f) in _QUANTIZERS if fmt == format)
        raise ValueError(f"{fn}: form={form!r} is not one of {format}'s forms: {allowed}")
    return quantizer(x, spec, key, fn)


def dequantize(q, dtype=jnp.float32) -> jax.Array:
    """The values of a stored tensor (`NVFP4Tensor`, `MXFP4Tensor` or `FP8Tensor`).

    NVFP4 (docs/numerics.md, section 3): e2m1_value(code) * float(scale_b) * (amax / 2688), in
    that order; MXFP4: e2m1_value(code) * 2**e. In the rotated domain when quantized with
    `rht=True`; NaN where the input was not finite.
    """
    if not isinstance(q, (BlockScaledTensor, FP8Tensor)):
        raise ValueError(f"dequantize: q has type {type(q).__name__}; expected one of "
                         "NVFP4Tensor, MXFP4Tensor, FP8Tensor")
    return q.dequantize(dtype)
