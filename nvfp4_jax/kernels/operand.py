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
from nvfp4_jax.kernels.quantize import BLOCK, Copy, fused_quantize


def kernel_copy(shape, *, axis, two_d, rht, stochastic, packed) -> Optional[Copy]:
    """The kernel copy that computes the reference's quantization of a tensor of `shape` viewed
    as 2-D (`view_2d`), or None where the kernels do not cover it. Arguments already checked."""
    ndim = len(shape)
    if two_d:
        return Copy("tiles", stochastic=stochastic, packed=packed)
    if axis == ndim - 1 and not rht and math.prod(shape[:-1]) % BLOCK == 0:
        return Copy("rows", stochastic=stochastic, packed=packed)
    if ndim == 2 and axis == 0 and shape[1] % BLOCK == 0:
        return Copy("cols", rht=rht, stochastic=stochastic, packed=packed)
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


_DEFAULTS = dict(axis=-1, two_d=False, rht=False, stochastic=False, key=None)


def _arguments(x, kw: dict, fn: str) -> dict:
    """The reference's keyword arguments with defaults filled in, checked as it checks them."""
    unknown = sorted(set(kw) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"{fn}: unknown argument(s) {unknown}; allowed: {', '.join(_DEFAULTS)}")
    args = dict(_DEFAULTS, **kw)
    args["axis"] = nvfp4._check_args(x, args["axis"], args["two_d"], args["rht"], args["stochastic"],
                                     args["key"], fn)
    return args


def _copy(x, args: dict, packed: bool) -> Optional[Copy]:
    return kernel_copy(x.shape, axis=args["axis"], two_d=args["two_d"], rht=args["rht"],
                       stochastic=args["stochastic"], packed=packed)


def _quantize(x, kw: dict, packed: bool, interpret, fn: str):
    args = _arguments(x, kw, fn)
    copy = _copy(x, args, packed)
    if copy is None:
        return (nvfp4.quantize_nvfp4 if packed else nvfp4.nvfp4_gemm_operand)(x, **args)
    [result] = fused_quantize(view_2d(x), [copy], [args["key"] if copy.stochastic else None],
                              interpret=interpret)
    return _from_2d(result, x, copy)


def quantize_nvfp4(x: jax.Array, *, interpret: Optional[bool] = None, **kw) -> nvfp4.NVFP4Tensor:
    """`nvfp4_jax.quant.quantize_nvfp4(x, **kw)` by the Pallas kernels: the same keyword
    arguments (axis, two_d, rht, stochastic, key), errors and bits.

    interpret: run the kernels in Pallas's interpreter (default: unless on a GPU).
    """
    return _quantize(x, kw, True, interpret, "quantize_nvfp4")


def gemm_operand(x: jax.Array, *, interpret: Optional[bool] = None, **kw) -> tuple[jax.Array, jax.Array]:
    """`nvfp4_jax.quant.nvfp4_gemm_operand(x, **kw)` by the Pallas kernels (as `quantize_nvfp4`)."""
    return _quantize(x, kw, False, interpret, "nvfp4_gemm_operand")


def gemm_operand_pair(x: jax.Array, first: dict, second: dict, *, interpret: Optional[bool] = None):
    """Two GEMM operands of one tensor, `(gemm_operand(x, **first), gemm_operand(x, **second))`,
    from one read of x where the kernels cover both (dY's DGRAD and WGRAD copies)."""
    args = [_arguments(x, kw, "gemm_operand_pair") for kw in (first, second)]
    copies = [_copy(x, a, packed=False) for a in args]
    if x.ndim != 2 or None in copies:
        return gemm_operand(x, **first, interpret=interpret), gemm_operand(x, **second, interpret=interpret)
    keys = [a["key"] if c.stochastic else None for a, c in zip(args, copies)]
    return tuple(fused_quantize(x, copies, keys, interpret=interpret))
