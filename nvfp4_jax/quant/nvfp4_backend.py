"""The NVFP4 operand-quantizer protocol: how an NVFP4 recipe's operands are quantized and its
GEMMs executed, bundled as an `NVFP4Backend`; `nvfp4_jax.kernels` and the XLA and TE backends
implement it without importing the dot (`nvfp4_jax.quant.dot`).

What a backend varies is two small functions:

- `operand(x, spec, key)`: quantize one GEMM operand as its `OperandSpec` says. The reference
  is `nvfp4.gemm_operand` (pure jnp): bf16 values `e2m1(code) * s_b` (exact in bf16) and the
  fp32 per-tensor decode scale.
- `gemm(a, b, dimension_numbers, out_dtype)`: run one GEMM on two such operands. The emulated
  one multiplies the bf16 values with fp32 accumulation, then applies `alpha`, the product of
  the two decode scales, in fp32, and rounds to the output dtype.
- optionally `operand_pair(x, (spec, key), (spec, key))`: two operands of one tensor (dY's
  DGRAD and WGRAD copies); a fused quantizer (`nvfp4_jax.kernels`) reads x once for both.
  Without it, `operand` is called twice.
- optionally `operand_group([(x, spec, key), ...])`: all the operands of one pass (FPROP's X
  and W; the backward's two dY copies and X^T), bit for bit `operand` of each, with the
  per-tensor factors computed together (`nvfp4.gemm_operand_group`): the program holds the
  integer-built factors twice per GEMM instead of five times, which is what XLA's compile time
  follows. Used in preference to `operand_pair` when both are given.

Stochastic-rounding keys: the DGRAD and WGRAD copies of dY get `fold_in(key, SR_DGRAD)` and
`fold_in(key, SR_WGRAD)` of the step's and layer's key (`sr_keys`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, ClassVar, Optional

import jax
import jax.numpy as jnp
from jax import lax

from nvfp4_jax.quant.formats import threefry2x32
from nvfp4_jax.quant.nvfp4 import gemm_operand, gemm_operand_group

# fold_in constants of dY's two stochastically rounded copies (DGRAD, WGRAD).
SR_DGRAD = 0
SR_WGRAD = 1


def sr_keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The stochastic-rounding keys of dY's DGRAD copy and WGRAD copy, derived from `key`:
    `fold_in(key, SR_DGRAD), fold_in(key, SR_WGRAD)`, bit for bit.

    For a threefry key (raw uint32[2] or typed) both come from one threefry call on the pair
    of fold-in counters: `fold_in(key, d)` is `threefry2x32(key, (0, d))`, so the program holds
    one cipher instead of two (XLA's compile time follows the program's size). Other PRNG
    implementations fold twice.
    """
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    impl = jax.random.key_impl(key) if typed else None
    data = jax.random.key_data(key) if typed else jnp.asarray(key)
    if (typed and str(impl) != "threefry2x32") or data.shape != (2,) or data.dtype != jnp.uint32:
        return jax.random.fold_in(key, SR_DGRAD), jax.random.fold_in(key, SR_WGRAD)
    counters = jnp.array([SR_DGRAD, SR_WGRAD], jnp.uint32)
    y0, y1 = threefry2x32(data[0], data[1], jnp.zeros_like(counters), counters)
    pair = jnp.stack([y0, y1], axis=-1)  # row i: the key folded with counters[i]
    if typed:
        pair = jax.random.wrap_key_data(pair, impl=impl)
    return pair[0], pair[1]


def emulated_gemm(a, b, dimension_numbers, out_dtype):
    """The emulated NVFP4 GEMM on two `nvfp4_gemm_operand` results `(values, decode_scale)`:
    bf16 x bf16 products accumulated in fp32, times alpha = the decode scales' product in fp32,
    rounded to `out_dtype`."""
    (a_values, a_decode), (b_values, b_decode) = a, b
    return bf16_gemm(a_values, b_values, a_decode * b_decode, dimension_numbers, out_dtype)


@dataclasses.dataclass(frozen=True)
class NVFP4Backend:
    """How an NVFP4 recipe's operands are quantized and its GEMMs executed (see module doc).

    `operand` and `gemm` must agree on the operand's form; `name` is what start-up lines print.
    """

    name: str = "emulated"
    operand: Callable = gemm_operand
    gemm: Callable = emulated_gemm
    operand_pair: Optional[Callable] = None
    operand_group: Optional[Callable] = None
    # Transformer Engine's executor replaces the whole dot; this one runs the skeleton below.
    replaces_dot: ClassVar[bool] = False

    def scope(self, batch_axes: tuple[str, str]):
        """Nothing is needed around tracing (TE's executor needs its MeshResource)."""
        return contextlib.nullcontext()

    def operands(self, x, first: tuple, second: tuple):
        """`(operand(x, *first), operand(x, *second))` for `(spec, key)` pairs, fused when the
        backend can."""
        if self.operand_pair is None:
            return self.operand(x, *first), self.operand(x, *second)
        return self.operand_pair(x, first, second)

    def group(self, items: list) -> list:
        """`[operand(x, spec, key) for x, spec, key in items]`: the operands of one pass, their
        per-tensor factors computed together when the backend can (`operand_group`); else dY's
        pair (the first two items, when they share x) through `operands`."""
        if self.operand_group is not None:
            return list(self.operand_group(items))
        if len(items) >= 2 and items[0][0] is items[1][0]:
            (x, *first), (_, *second) = items[:2]
            return [*self.operands(x, tuple(first), tuple(second)), *self.group(items[2:])]
        return [self.operand(x, spec, key) for x, spec, key in items]


EMULATED = NVFP4Backend(operand_group=gemm_operand_group)


def bf16_gemm(a, b, alpha, dims, out_dtype):
    """bf16 x bf16 products accumulated in fp32, times alpha in fp32, rounded to out_dtype."""
    acc = lax.dot_general(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dims, preferred_element_type=jnp.float32
    )
    return (acc * alpha).astype(out_dtype)
