"""The quantized GEMM of one linear layer, as a drop-in for `jax.lax.dot_general`.

For `Y = X . W` (X `[T, K]` with all leading dims flattened into tokens T, W `[K, N]`) the
custom VJP below writes out the three GEMMs of docs/recipes.md's operand table once, for every format,
each operand quantized for its own usage:

    FPROP  Y  = X   . W     X 1x16 along K (RN)          W 16x16 tiles (RN)
    DGRAD  dX = dY  . W^T   dY 1x16 along N (SR)         W^T: the forward's quantized W
    WGRAD  dW = X^T . dY    X^T 1x16 along T (RHT, RN)   dY^T 1x16 along T (RHT, SR)

(the NVFP4 column; `recipe.operand_specs` gives every recipe's `OperandSpec` per role, None
where the backward reuses a forward quantization). What varies by format is a quantizer set
(`Quantizers`: NVFP4, MXFP4, FP8): how to quantize an operand for its spec, the GEMM on two
such operands, and an optional state update (delayed FP8's amax history). The statistics hook
lives in "quantize an operand", once.

What an NVFP4 backend varies (its operand quantizer and its GEMM) is an `NVFP4Backend`
(`nvfp4_jax.quant.nvfp4_backend`); the quantizer sets live in `nvfp4_jax.quant.quantizers`.

Stochastic-rounding keys: the caller passes one key per step and layer (`QuantDotGeneral`
draws it from the "quant" rng stream); the DGRAD and WGRAD copies of dY get
`fold_in(key, SR_DGRAD)` and `fold_in(key, SR_WGRAD)` (`nvfp4_backend.sr_keys`).

Quantization statistics (`health`): handed a zero statistics pytree, the dot also measures every
operand it quantizes, with the same spec and key, and returns the measurements as that pytree's
cotangent. Without one (the default) the computation is exactly the plain GEMMs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from nvfp4_jax.quant import fp8_delayed, health
from nvfp4_jax.quant.nvfp4_backend import EMULATED, NVFP4Backend
from nvfp4_jax.quant.quantizers import Quantizers, quantizers
from nvfp4_jax.quant.recipe import Recipe, recipe_name, require_recipe

# lax.dot_general dimension numbers of the three GEMMs on X [T, K], W [K, N], dY [T, N].
_FPROP_DIMS = (((1,), (0,)), ((), ()))  # X . W
_DGRAD_DIMS = (((1,), (1,)), ((), ()))  # dY . W^T
_WGRAD_DIMS = (((0,), (0,)), ((), ()))  # X^T . dY

DotGeneral = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the custom VJP needs that is not an array (hashable: a nondiff argument)."""

    quantizers: "Quantizers"
    w_cast: Any  # the dtype W is quantized from (None: as given)
    out_dtype: Any
    x_dtype: Any
    w_dtype: Any


def make_dot_general(
    recipe: Recipe,
    key: Optional[jax.Array] = None,
    *,
    fp8_meta: Optional[fp8_delayed.FP8Meta] = None,
    backend: NVFP4Backend = EMULATED,
    quant_stats: Optional[dict] = None,
    kernel_dtype: Any = None,
) -> DotGeneral:
    """A function with `lax.dot_general`'s signature that runs `recipe`'s quantized GEMMs.

    Args:
      recipe: the `Recipe` (`get_recipe("te_nvfp4")`, ...); a BF16 one returns `lax.dot_general`.
      key: PRNG key for stochastic rounding; required when the recipe rounds gradients
        stochastically. Pass a different key per step and per layer.
      fp8_meta: delayed-scaling FP8 state of this layer (`fp8_delayed.init_fp8_meta`); required
        for "te_fp8_delayedscaling". The gradient with respect to it is the next state.
      backend: how NVFP4 operands are quantized and GEMMs run (`NVFP4Backend`; default: the
        pure-jnp reference quantizer and the emulated GEMM; `backends.make_backend("xla")`
        runs them through `jax.nn.scaled_matmul`). Also the hook for experiments, e.g. an
        identity quantizer.
      kernel_dtype: quantize `rhs` (the kernel) from this dtype, e.g. bfloat16: the compute-dtype
        copy that MaxText hands Transformer Engine, so the operands are TE's. The gradient
        with respect to `rhs` stays in rhs's own dtype (fp32 for a master kernel), from the
        fp32 accumulator; TE returns it in bf16. None (default): quantize `rhs` as given.
      quant_stats: `health.init_stats(recipe)` (zeros) to measure this GEMM's operands: the
        gradient with respect to it is `{operand: {stat: value}}` of the forward and backward
        pass (see `health`). The NVFP4 statistics come from the reference quantizer, whatever
        the backend. None (default) adds nothing to the computation.

    Only the dense case is supported: `lhs[..., K]` contracting its last dim with `rhs[K, N]`,
    no batch dims. The Transformer Engine backend is reached through `QuantDotGeneral` only.
    """
    recipe = require_recipe(recipe, "make_dot_general")
    if recipe.is_bf16:
        return lax.dot_general
    name = recipe_name(recipe)
    if not isinstance(backend, NVFP4Backend):
        raise ValueError(
            f"{name}: backend={backend!r}; make_dot_general takes an NVFP4Backend (Transformer "
            "Engine replaces the whole dot and runs through QuantDotGeneral)"
        )
    if recipe.needs_rng and key is None:
        raise ValueError(
            f"{name} rounds gradients stochastically and needs a PRNG key: "
            "make_dot_general(recipe, key) with a different key every step and layer"
        )
    if recipe.fp8_delayed:
        if fp8_meta is None:
            raise ValueError(
                f"{name} needs its amax-history state: make_dot_general(recipe, "
                f"fp8_meta=init_fp8_meta({recipe.amax_history_len})) or QuantDotGeneral"
            )
        fp8_delayed.check_fp8_meta(fp8_meta, recipe.amax_history_len)
    elif fp8_meta is not None:
        raise ValueError(f"{name} keeps no FP8 state; fp8_meta must be None")
    if quant_stats is not None:
        health.check_stats(quant_stats, recipe, name)
    if not recipe.needs_rng:
        key = None

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        # `precision` does not apply: the operands are exact in bf16 and products accumulate
        # in fp32 whatever it says.
        del precision
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        k, n = _check_dense(lhs, rhs, dimension_numbers, name)
        tokens = math.prod(lhs.shape[:-1])
        _check_blocks(recipe, name, tokens=tokens, k=k, n=n)
        out_dtype = jnp.dtype(
            jnp.result_type(lhs, rhs) if preferred_element_type is None else preferred_element_type
        )
        w_cast = None if kernel_dtype is None else jnp.dtype(kernel_dtype)
        static = _Static(quantizers(recipe, backend), w_cast, out_dtype, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))
        y = _quantized_matmul(static, lhs.reshape(tokens, k), rhs, key, fp8_meta, quant_stats)
        return y.reshape(*lhs.shape[:-1], n)

    return dot_general


def _check_dense(lhs, rhs, dimension_numbers, name: str) -> tuple[int, int]:
    supported = f"(((lhs.ndim - 1,), (0,)), ((), ())) = ((({lhs.ndim - 1},), (0,)), ((), ()))"
    def normalize(dims, ndim):
        dims = tuple(int(d) for d in dims)
        if any(not -ndim <= d < ndim for d in dims):
            raise ValueError
        return tuple(d % ndim for d in dims)

    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc = normalize(lc, lhs.ndim), normalize(rc, rhs.ndim)
        lb, rb = tuple(lb), tuple(rb)
    except (TypeError, ValueError, ZeroDivisionError):
        lc = rc = lb = rb = None
    if lhs.ndim < 1 or rhs.ndim != 2 or lc != (lhs.ndim - 1,) or rc != (0,) or lb or rb:
        raise ValueError(
            f"quantized dot_general ({name}) supports only the dense layer case lhs[..., K] x "
            f"rhs[K, N] with dimension_numbers {supported}; got dimension_numbers="
            f"{dimension_numbers!r} for lhs shape {lhs.shape} and rhs shape {rhs.shape}"
        )
    if lhs.shape[-1] != rhs.shape[0]:
        raise ValueError(
            f"quantized dot_general ({name}): contracting sizes differ, lhs shape {lhs.shape} "
            f"(K={lhs.shape[-1]}) vs rhs shape {rhs.shape} (K={rhs.shape[0]})"
        )
    for side, arr in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise ValueError(f"quantized dot_general ({name}): {side} dtype {arr.dtype} is not floating")
    return rhs.shape[0], rhs.shape[1]


def _check_blocks(recipe: Recipe, name: str, *, tokens: int, k: int, n: int) -> None:
    block = recipe.block_size
    if block is None:
        return
    # Each of T, K, N is a blocked (contraction) axis of some GEMM operand.
    bad = {dim: size for dim, size in (("tokens T", tokens), ("K", k), ("N", n)) if size % block}
    if bad:
        listed = ", ".join(f"{dim}={size}" for dim, size in bad.items())
        raise ValueError(
            f"quantized dot_general ({name}): {listed} not a multiple of the block size {block}; "
            f"token count (product of lhs leading dims), K and N must all be multiples of {block}"
        )


# --- the custom VJP: the three GEMMs, written once ---------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _quantized_matmul(static: _Static, x_TxK, w_KxN, key, meta, stats):
    return _fwd(static, x_TxK, w_KxN, key, meta, stats)[0]


def _fwd(static: _Static, x_TxK, w_KxN, key, meta, stats):
    qs = static.quantizers
    aux = qs.aux(key, meta)
    # `seen` collects the operand statistics when asked for (None: nothing is measured).
    seen = None if stats is None else {}
    specs = qs.specs
    if static.w_cast is not None:
        w_KxN = w_KxN.astype(static.w_cast)
    # FPROP  Y = X . W
    xq, wq = _quantize_group(qs, [(specs["x"], x_TxK), (specs["w"], w_KxN)], aux, seen)
    y_TxN = qs.gemm(xq, wq, _FPROP_DIMS, static.out_dtype)
    # The backward keeps the high-precision tensor where it quantizes it again, else the
    # forward's quantized one (its own transpose: 16x16 tiles, per-tensor FP8).
    x_res = x_TxK if specs["x_wgrad"] is not None else xq
    w_res = w_KxN if specs["w_dgrad"] is not None else wq
    state = qs.state_inputs({"x": xq, "w": wq})
    return y_TxN, ((x_res, w_res, aux, state), seen)


def _bwd(static: _Static, res, dy_TxN):
    (x_res, w_res, aux, state), seen = res
    qs = static.quantizers
    specs = qs.specs
    # The backward's operands in one group: dY's DGRAD and WGRAD copies (one read of dY where
    # the quantizer fuses them; FP8 uses one), and W and X again where the recipe quantizes
    # them anew (None: the forward's quantized tensor serves).
    roles = [r for r in ("dy", "dy_wgrad", "w_dgrad", "x_wgrad") if specs[r] is not None]
    tensors = {"dy": dy_TxN, "dy_wgrad": dy_TxN, "w_dgrad": w_res, "x_wgrad": x_res}
    got = dict(zip(roles, _quantize_group(qs, [(specs[r], tensors[r]) for r in roles], aux, seen)))
    dyq = got["dy"]
    dyq_wgrad = got.get("dy_wgrad", dyq)
    # DGRAD  dX = dY . W^T
    dx_TxK = qs.gemm(dyq, got.get("w_dgrad", w_res), _DGRAD_DIMS, static.x_dtype)
    # WGRAD  dW = X^T . dY
    dw_KxN = qs.gemm(got.get("x_wgrad", x_res), dyq_wgrad, _WGRAD_DIMS, static.w_dtype)
    # Overwrite-with-gradient: the cotangent of this step's state is the next state, and the
    # statistics pytree's cotangent is the statistics.
    next_meta = None if state is None else qs.next_state(aux, {**state, "dy": dyq})
    return dx_TxK, dw_KxN, None, next_meta, seen


_quantized_matmul.defvjp(_fwd, _bwd)


def _quantize_group(qs: "Quantizers", items: list, aux, seen: Optional[dict]) -> list:
    """Quantize the `(spec, x)` operands of one pass; the statistics hook: each measured with
    the very spec and key used."""
    if seen is not None:
        for spec, x in items:
            seen[spec.role] = qs.measure(x, spec, aux)
    return qs.quantize_group(items, aux)
