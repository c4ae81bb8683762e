"""The Pallas kernels behind the reference's signatures: drop-in `quantize_nvfp4`,
`nvfp4_gemm_operand`, and the fused pair of one tensor's two GEMM operands.

Arguments, errors and results are the reference's (`nvfp4_jax.quant.nvfp4`), bit for bit. The
kernels cover what the quantized GEMM asks for: 16x16 tiles of a 2-D weight, 1x16 blocks along
the last axis of a tensor whose leading dims hold a multiple of 16 rows, and 1x16 blocks along
axis 0 of a 2-D tensor with N a multiple of 16 (with or without the RHT). Anything else (the
RHT along the last axis, a block axis in the middle, ragged row counts) runs the jnp reference.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax

from nvfp4_jax.quant import nvfp4
from nvfp4_jax.quant.spec import OperandSpec
from nvfp4_jax.kernels.quantize import BLOCK, Copy, fused_quantize


def kernel_copy(shape, spec: OperandSpec, *, packed: bool) -> Optional[Copy]:
    """The kernel copy that computes the reference's quantization of a tensor of `shape` viewed
    as 2-D (`view_2d`), or None where the kernels do not cover it. `spec` already checked."""
    ndim = len(shape)
    if spec.two_d:
        return Copy("tiles", stochastic=spec.stochastic, packed=packed)
    if spec.axis == ndim - 1 and not spec.rht and math.prod(shape[:-1]) % BLOCK == 0:
        return Copy("rows", stochastic=spec.stochastic, packed=packed)
    if ndim == 2 and spec.axis == 0 and shape[1] % BLOCK == 0:
        return Copy("cols", rht=spec.rht, stochastic=spec.stochastic, packed=packed)
    return None


def view_2d(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x


def _from_2d(result, x: jax.Array, copy: Copy):
    """A 2-D view's result in `x`'s own shape."""
    if x.ndim == 2:
        return result
    if not copy.packed:
        values, scale = result
        return values.reshape(x.shape), scale
    lead = x.shape[:-1]
    return dataclasses.replace(
        result,
        codes=result.codes.reshape(lead + (-1,)),
        scales=result.scales.reshape(lead + (-1,)),
        shape=tuple(x.shape),
        axis=x.ndim - 1,
    )


_KEYWORDS = ("axis", "two_d", "rht", "stochastic", "key")


def _spec(kw: dict, fn: str) -> tuple[OperandSpec, Optional[jax.Array]]:
    """The reference's keyword arguments as (spec, key)."""
    unknown = sorted(set(kw) - set(_KEYWORDS))
    if unknown:
        raise ValueError(f"{fn}: unknown argument(s) {unknown}; allowed: {', '.join(_KEYWORDS)}")
    kw = dict(kw)
    key = kw.pop("key", None)
    return OperandSpec(**kw), key


def _quantize(x, spec: OperandSpec, key, packed: bool, interpret, fn: str):
    checked = nvfp4.check_operand(x, spec, key, fn)
    copy = kernel_copy(x.shape, checked, packed=packed)
    if copy is None:
        if packed:
            return nvfp4.pack(x.shape, nvfp4.quantize_blocks(x, spec, key, fn=fn), checked)
        return nvfp4.gemm_operand(x, spec, key, fn=fn)
    [result] = fused_quantize(view_2d(x), [copy], [key if copy.stochastic else None], interpret=interpret)
    return _from_2d(result, x, copy)


def quantize_nvfp4(x: jax.Array, *, interpret: Optional[bool] = None, **kw) -> nvfp4.NVFP4Tensor:
    """`nvfp4_jax.quant.quantize_nvfp4(x, **kw)` by the Pallas kernels: the same keyword
    arguments (axis, two_d, rht, stochastic, key), errors and bits.

    interpret: run the kernels in Pallas's interpreter (default: unless on a GPU).
    """
    return _quantize(x, *_spec(kw, "quantize_nvfp4"), True, interpret, "quantize_nvfp4")


def gemm_operand(x: jax.Array, *, interpret: Optional[bool] = None, **kw) -> tuple[jax.Array, jax.Array]:
    """`nvfp4_jax.quant.nvfp4_gemm_operand(x, **kw)` by the Pallas kernels (as `quantize_nvfp4`)."""
    return _quantize(x, *_spec(kw, "nvfp4_gemm_operand"), False, interpret, "nvfp4_gemm_operand")


def spec_operand(x: jax.Array, spec: OperandSpec, key=None, *, interpret: Optional[bool] = None):
    """`nvfp4_jax.quant.nvfp4.gemm_operand(x, spec, key)` by the Pallas kernels: the operand
    quantizer of an `NVFP4Backend`."""
    return _quantize(x, spec, key, False, interpret, "nvfp4_gemm_operand")


def spec_operand_pair(x: jax.Array, first: tuple, second: tuple, *, interpret: Optional[bool] = None):
    """Two GEMM operands of one tensor from `(spec, key)` pairs, from one read of x where the
    kernels cover both (dY's DGRAD and WGRAD copies): an `NVFP4Backend`'s `operand_pair`."""
    checked = [nvfp4.check_operand(x, spec, key, "gemm_operand_pair") for spec, key in (first, second)]
    copies = [kernel_copy(x.shape, spec, packed=False) for spec in checked]
    if x.ndim != 2 or None in copies:
        return (spec_operand(x, *first, interpret=interpret), spec_operand(x, *second, interpret=interpret))
    keys = [key if c.stochastic else None for (_, key), c in zip((first, second), copies)]
    return tuple(fused_quantize(x, copies, keys, interpret=interpret))


def gemm_operand_pair(x: jax.Array, first: dict, second: dict, *, interpret: Optional[bool] = None):
    """Two GEMM operands of one tensor, `(gemm_operand(x, **first), gemm_operand(x, **second))`,
    from one read of x where the kernels cover both (dY's DGRAD and WGRAD copies)."""
    return spec_operand_pair(x, _spec(first, "gemm_operand_pair"), _spec(second, "gemm_operand_pair"),
                             interpret=interpret)
