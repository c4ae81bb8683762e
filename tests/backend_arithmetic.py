"""Emulate, on XLA:CPU, the float32 arithmetic that other backends are allowed to produce.

Two freedoms a GPU backend really takes (docs/numerics.md, "Same bits on every backend"):

- **Faithfully rounded division.** XLA:GPU lowers float32 division to PTX `div.full.f32`,
  which may be off by up to 2 ulp (openxla/xla issue 37181). `faithful_division()` re-lowers
  every float32 divide (`lax.div`, and `lax.integer_pow` with a negative exponent, which
  lowers to one) as the exact quotient moved by -2..+2 ulp; which elements move, and how far,
  is a hash of the operands' bits, so about half of all quotients are off and runs repeat.
- **Multiply-add contraction.** PTX `mul.f32` followed by `add.f32` may be fused into one
  `fma.f32` (one rounding instead of two). `fma_contraction()` re-lowers float32 add and
  subtract whose operand comes straight from a float32 multiply as that fused operation
  (computed in float64, rounded once to float32). XLA:CPU itself contracts a multiply and an
  add inside one fused loop (measured with jax 0.10), and eager op-by-op execution never
  does: tests that run a path both eagerly and under `jit` see both behaviours already.

Both are context managers that patch JAX's MLIR lowering rules for their duration and clear
JAX's compilation caches on entry and exit, so every function traced inside sees them, eagerly
and under `jit`. `perturbed_arithmetic()` applies both. They are test tools: nothing in the
package may depend on them.
"""

from __future__ import annotations

import contextlib

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.interpreters import mlir as _mlir  # the lowering-rule table is private
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax.interpreters import mlir

# Offsets in ulp chosen by 3 bits of the hash: half the quotients stay exact.
_ULP_OFFSETS = np.array([0, 0, 0, 0, 1, -1, 2, -2], np.int32)


def _mix(a_bits, b_bits):
    h = a_bits * np.uint32(0x9E3779B1) ^ (b_bits * np.uint32(0x85EBCA77) + np.uint32(0x165667B1))
    h = h ^ (h >> 15)
    h = h * np.uint32(0x2C1B3C6D)
    return h ^ (h >> 12)


def nudge(q, a, b):
    """`q` (float32) moved by -2..+2 ulp, chosen per element by a hash of `a` and `b`'s bits.

    Zero, Inf and NaN quotients stay put (a faithful division gets those right), and so does
    any quotient the move would carry across zero or to Inf.
    """
    qa, ab, bb = (lax.bitcast_convert_type(v, jnp.uint32) for v in (q, a, b))
    off = jnp.asarray(_ULP_OFFSETS)[(_mix(ab, bb) >> 29).astype(jnp.int32)]
    mag = (qa & np.uint32(0x7FFFFFFF)).astype(jnp.int32)
    moved = mag + off
    ok = (mag > 0) & (mag < 0x7F800000) & (moved > 0) & (moved < 0x7F800000)
    mag = jnp.where(ok, moved, mag).astype(jnp.uint32)
    return lax.bitcast_convert_type(mag | (qa & np.uint32(0x80000000)), jnp.float32)


# A primitive that divides exactly (the original lowering), for use inside the patched rules.
_exact_div_p = jex.core.Primitive("exact_div_for_tests")
_exact_div_p.def_abstract_eval(lambda a, b: a.update(weak_type=False))


def _is_f32(aval) -> bool:
    return getattr(aval, "dtype", None) == jnp.float32


@contextlib.contextmanager
def _patched(rules: dict):
    saved = {prim: _mlir._lowerings.get(prim) for prim in rules}
    jax.clear_caches()
    try:
        for prim, rule in rules.items():
            mlir.register_lowering(prim, rule)
        yield
    finally:
        for prim, entry in saved.items():
            if entry is None:
                _mlir._lowerings.pop(prim, None)
            else:
                _mlir._lowerings[prim] = entry
        jax.clear_caches()


@contextlib.contextmanager
def faithful_division():
    """Every float32 division is faithfully, not correctly, rounded (see module docstring)."""
    div_rule = _mlir._lowerings[lax.div_p].rule
    pow_rule = _mlir._lowerings[lax.integer_pow_p].rule
    mlir.register_lowering(_exact_div_p, div_rule)

    def nudged_div(a, b):
        # lax.div may pair a rank-0 operand with an array.
        shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
        a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
        return nudge(_exact_div_p.bind(a, b), a, b)

    lowered_div = mlir.lower_fun(nudged_div, multiple_results=False)

    def div(ctx, a, b):
        if not _is_f32(ctx.avals_out[0]):
            return div_rule(ctx, a, b)
        return lowered_div(ctx, a, b)

    def integer_pow(ctx, x, *, y):
        if y >= 0 or not _is_f32(ctx.avals_out[0]):
            return pow_rule(ctx, x, y=y)
        return mlir.lower_fun(
            lambda v: nudged_div(jnp.ones_like(v), lax.integer_pow(v, -y)), multiple_results=False
        )(ctx, x)

    with _patched({lax.div_p: div, lax.integer_pow_p: integer_pow}):
        yield


def _multiply_operands(value):
    """(x, y) when `value` is the float32 result of a stablehlo.multiply, else None."""
    owner = getattr(value, "owner", None)
    op = getattr(owner, "operation", owner)
    if op is None or getattr(op, "name", None) != "stablehlo.multiply":
        return None
    return op.operands[0], op.operands[1]


def _fused(ctx, x, y, c, negate_product: bool, negate_addend: bool):
    aval = ctx.avals_out[0]
    f64 = ir.RankedTensorType.get(aval.shape, ir.F64Type.get())
    f32 = mlir.aval_to_ir_type(aval)
    x, y, c = (hlo.convert(f64, v) for v in (x, y, c))
    prod = hlo.multiply(x, y)
    if negate_product:
        prod = hlo.negate(prod)
    if negate_addend:
        c = hlo.negate(c)
    return [hlo.convert(f32, hlo.add(prod, c))]


@contextlib.contextmanager
def fma_contraction():
    """float32 `a * b + c` (and `c + a * b`, `a * b - c`, `c - a * b`) rounds once, as an FMA."""
    add_rule = _mlir._lowerings[lax.add_p].rule
    sub_rule = _mlir._lowerings[lax.sub_p].rule

    def make(rule, subtract: bool):
        def lower(ctx, lhs, rhs):
            same = all(a.shape == ctx.avals_out[0].shape for a in ctx.avals_in)
            if _is_f32(ctx.avals_out[0]) and same:
                mul = _multiply_operands(lhs)
                if mul is not None:
                    return _fused(ctx, *mul, rhs, negate_product=False, negate_addend=subtract)
                mul = _multiply_operands(rhs)
                if mul is not None:
                    return _fused(ctx, *mul, lhs, negate_product=subtract, negate_addend=False)
            return rule(ctx, lhs, rhs)

        return lower

    with _patched({lax.add_p: make(add_rule, False), lax.sub_p: make(sub_rule, True)}):
        yield


@contextlib.contextmanager
def perturbed_arithmetic():
    """Faithful division and FMA contraction together: what a GPU backend may legally do."""
    with faithful_division(), fma_contraction():
        yield


ARITHMETIC_MODES = {
    "ieee": contextlib.nullcontext,
    "perturbed": perturbed_arithmetic,
}
