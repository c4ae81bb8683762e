"""The quantized GEMM of one linear layer, as a drop-in for `jax.lax.dot_general`.

For `Y = X . W` (X `[T, K]` with all leading dims flattened into tokens T, W `[K, N]`) the
custom VJP below writes out the three GEMMs of NVFP4_SPEC.md section 7, each operand quantized
for its own usage from the high-precision tensor:

    FPROP  Y  = X   . W     X 1x16 along K (RN)          W 16x16 tiles (RN)
    DGRAD  dX = dY  . W^T   dY 1x16 along N (SR)         W^T: the forward's quantized W
    WGRAD  dW = X^T . dY    X^T 1x16 along T (RHT, RN)   dY^T 1x16 along T (RHT, SR)

The three GEMMs are written once. What a backend varies is two small functions (STYLE.md,
practice 15), bundled as an `NVFP4Backend`:

- `operand(x, *, axis, two_d, rht, stochastic, key)`: quantize one GEMM operand. The reference
  is `nvfp4_gemm_operand` (pure jnp): bf16 values `e2m1(code) * s_b` (exact in bf16) and the
  fp32 per-tensor decode scale.
- `gemm(a, b, dimension_numbers, out_dtype)`: run one GEMM on two such operands. The emulated
  one multiplies the bf16 values with fp32 accumulation, then applies `alpha`, the product of
  the two decode scales, in fp32, and rounds to the output dtype.
- optionally `operand_pair(x, first, second)`: two operands of one tensor (dY's DGRAD and WGRAD
  copies), `first` and `second` being `operand`'s keyword arguments; a fused quantizer
  (`nvfp4_jax.kernels`) reads x once for both. Without it, `operand` is called twice.

The FP8 and MXFP4 baselines use the same structure with their own operands.

Stochastic-rounding keys: the caller passes one key per step and layer (`QuantDotGeneral`
draws it from the "quant" rng stream); the DGRAD and WGRAD copies of dY get
`fold_in(key, 0)` and `fold_in(key, 1)`.

Quantization statistics (`health`): handed a zero statistics pytree, the dot also measures every
operand it quantizes, with the same arguments, and returns the measurements as that pytree's
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

from nvfp4_jax.quant import formats as F
from nvfp4_jax.quant import fp8_delayed, health
from nvfp4_jax.quant.fp8 import quantize_fp8
from nvfp4_jax.quant.mxfp4 import quantize_mxfp4
from nvfp4_jax.quant.nvfp4 import dequantize, nvfp4_gemm_operand
from nvfp4_jax.quant.recipe import Recipe, get_recipe, recipe_name
from nvfp4_jax.quant.te_backend import TEBackend

# fold_in constants: the two stochastically rounded copies of dY must not share random bits.
SR_DGRAD = 0
SR_WGRAD = 1

# lax.dot_general dimension numbers of the three GEMMs on X [T, K], W [K, N], dY [T, N].
_FPROP_DIMS = (((1,), (0,)), ((), ()))  # X . W
_DGRAD_DIMS = (((1,), (1,)), ((), ()))  # dY . W^T
_WGRAD_DIMS = (((0,), (0,)), ((), ()))  # X^T . dY

DotGeneral = Callable[..., jax.Array]


def sr_keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The stochastic-rounding keys of dY's DGRAD copy and WGRAD copy, derived from `key`."""
    return jax.random.fold_in(key, SR_DGRAD), jax.random.fold_in(key, SR_WGRAD)


def emulated_gemm(a, b, dimension_numbers, out_dtype):
    """The emulated NVFP4 GEMM on two `nvfp4_gemm_operand` results `(values, decode_scale)`:
    bf16 x bf16 products accumulated in fp32, times alpha = the decode scales' product in fp32,
    rounded to `out_dtype`."""
    (a_values, a_decode), (b_values, b_decode) = a, b
    return _gemm(a_values, b_values, a_decode * b_decode, dimension_numbers, out_dtype)


@dataclasses.dataclass(frozen=True)
class NVFP4Backend:
    """How an NVFP4 recipe's operands are quantized and its GEMMs executed (see module doc).

    `operand` and `gemm` must agree on the operand's form; `name` is what start-up lines print.
    """

    name: str = "emulated"
    operand: Callable = nvfp4_gemm_operand
    gemm: Callable = emulated_gemm
    operand_pair: Optional[Callable] = None

    def operands(self, x, first: dict, second: dict):
        """`(operand(x, **first), operand(x, **second))`, fused when the backend can."""
        if self.operand_pair is None:
            return self.operand(x, **first), self.operand(x, **second)
        return self.operand_pair(x, first, second)


EMULATED = NVFP4Backend()


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the custom VJP needs that is not an array (hashable: a nondiff argument)."""

    recipe: Recipe
    backend: NVFP4Backend
    out_dtype: Any
    x_dtype: Any
    w_dtype: Any


def make_dot_general(
    recipe="te_nvfp4",
    key: Optional[jax.Array] = None,
    *,
    fp8_meta: Optional[fp8_delayed.FP8Meta] = None,
    backend: NVFP4Backend = EMULATED,
    quant_stats: Optional[dict] = None,
) -> DotGeneral:
    """A function with `lax.dot_general`'s signature that runs `recipe`'s quantized GEMMs.

    Args:
      recipe: a `Recipe` or its flag ("te_nvfp4", ...). "bf16"/"" returns `lax.dot_general`.
      key: PRNG key for stochastic rounding; required when the recipe rounds gradients
        stochastically. Pass a different key per step and per layer.
      fp8_meta: delayed-scaling FP8 state of this layer (`fp8_delayed.init_fp8_meta`); required
        for "te_fp8_delayedscaling". The gradient with respect to it is the next state.
      backend: how NVFP4 operands are quantized and GEMMs run (`NVFP4Backend`; default: the
        pure-jnp reference quantizer and the emulated GEMM; `backends.make_backend("xla")`
        runs them through `jax.nn.scaled_matmul`). Also the hook for experiments, e.g. an
        identity quantizer.
      quant_stats: `health.init_stats(recipe)` (zeros) to measure this GEMM's operands: the
        gradient with respect to it is `{operand: {stat: value}}` of the forward and backward
        pass (see `health`). The NVFP4 statistics come from the reference quantizer, whatever
        the backend. None (default) adds nothing to the computation.

    Only the dense case is supported: `lhs[..., K]` contracting its last dim with `rhs[K, N]`,
    no batch dims. The Transformer Engine backend is reached through `QuantDotGeneral` only.
    """
    recipe = get_recipe(recipe)
    if recipe.is_bf16:
        return lax.dot_general
    name = recipe_name(recipe)
    if isinstance(backend, TEBackend):
        raise ValueError(
            f"{name}: the te backend runs through the Flax module QuantDotGeneral (TE keeps its "
            "rng and state in Flax collections); make_dot_general takes an NVFP4Backend"
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
        static = _Static(recipe, backend, out_dtype, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))
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


# --- the custom VJP ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _quantized_matmul(static: _Static, x, w, key, meta, stats):
    return _fwd(static, x, w, key, meta, stats)[0]


def _fwd(static: _Static, x, w, key, meta, stats):
    # `seen` collects the operand statistics when asked for (None: nothing is measured).
    seen = None if stats is None else {}
    fmt = static.recipe.format
    if fmt == "nvfp4":
        y, res = _nvfp4_fwd(static, x, w, key, seen)
    elif fmt == "mxfp4":
        y, res = _mxfp4_fwd(static, x, w, seen)
    else:
        y, res = _fp8_fwd(static, x, w, meta, seen)
    return y, (res, seen)


def _bwd(static: _Static, res, g):
    res, seen = res
    fmt = static.recipe.format
    if fmt == "nvfp4":
        grads = _nvfp4_bwd(static, res, g, seen)
    elif fmt == "mxfp4":
        grads = _mxfp4_bwd(static, res, g, seen)
    else:
        grads = _fp8_bwd(static, res, g, seen)
    # Overwrite-with-gradient: the statistics pytree's cotangent is the statistics.
    return (*grads, seen)


_quantized_matmul.defvjp(_fwd, _bwd)


def _observed(quantize: Callable, measure: Callable, seen: Optional[dict]) -> Callable:
    """`quantize`, called as `(name, x, **args)`; also records `measure(x, **args)` under `name`
    in `seen` when statistics are collected, so they describe exactly what was quantized."""

    def operand(name: str, x, **args):
        if seen is not None:
            seen[name] = measure(x, **args)
        return quantize(x, **args)

    return operand


def _gemm(a, b, alpha, dims, out_dtype):
    """bf16 x bf16 products accumulated in fp32, times alpha in fp32, rounded to out_dtype."""
    acc = lax.dot_general(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dims, preferred_element_type=jnp.float32
    )
    return (acc * alpha).astype(out_dtype)


# --- NVFP4 ------------------------------------------------------------------------------------


def _nvfp4_fwd(static: _Static, x, w, key, seen):
    r, gemm = static.recipe, static.backend.gemm
    quant = _observed(static.backend.operand, health.nvfp4_stats, seen)
    # FPROP  Y = X . W: X 1x16 along K, W in 16x16 tiles (or 1x16 along K), round to nearest.
    xq = quant("x", x, axis=1)
    wq = quant("w", w, axis=0, two_d=r.two_d_weights)
    y = gemm(xq, wq, _FPROP_DIMS, static.out_dtype)
    # 2D tiles make the quantized W its own transpose: DGRAD reuses it. 1x16 weights must be
    # requantized along N from the high-precision W.
    w_for_dgrad = wq if r.two_d_weights else w
    return y, (x, w_for_dgrad, key)


def _nvfp4_bwd(static: _Static, res, g, seen):
    r, gemm = static.recipe, static.backend.gemm
    quant = _observed(static.backend.operand, health.nvfp4_stats, seen)
    x, w_for_dgrad, key = res
    k_dgrad, k_wgrad = sr_keys(key) if r.sr_gradients else (None, None)
    sr = r.sr_gradients

    # dY's two copies (one read of dY where the backend fuses them): DGRAD's 1x16 along N
    # (SR); WGRAD's 1x16 along tokens (RHT, SR).
    dy_args = dict(axis=1, stochastic=sr, key=k_dgrad)
    dy_wgrad_args = dict(axis=0, rht=r.rht_wgrad, stochastic=sr, key=k_wgrad)
    if seen is not None:
        seen["dy"] = health.nvfp4_stats(g, **dy_args)
        seen["dy_wgrad"] = health.nvfp4_stats(g, **dy_wgrad_args)
    gq, gt = static.backend.operands(g, dy_args, dy_wgrad_args)

    # DGRAD  dX = dY . W^T: W^T the forward's quantized W.
    wq = w_for_dgrad if r.two_d_weights else quant("w_dgrad", w_for_dgrad, axis=1)
    dx = gemm(gq, wq, _DGRAD_DIMS, static.x_dtype)

    # WGRAD  dW = X^T . dY: both 1x16 along tokens, RHT on both (it cancels in the product),
    # SR on dY only.
    xt = quant("x_wgrad", x, axis=0, rht=r.rht_wgrad)
    dw = gemm(xt, gt, _WGRAD_DIMS, static.w_dtype)
    return dx, dw, None, None


# --- MXFP4 ------------------------------------------------------------------------------------


def _mxfp4_operand(x, axis):
    # E2M1 times a power of two: exact in bf16 (outside the far ends of the E8M0 range).
    return dequantize(quantize_mxfp4(x, axis=axis), jnp.bfloat16)


def _mxfp4_fwd(static: _Static, x, w, seen):
    quant = _observed(_mxfp4_operand, health.mxfp4_stats, seen)
    # FPROP  Y = X . W: 32-blocks along K on both operands; no per-tensor scale.
    y = _gemm(quant("x", x, axis=1), quant("w", w, axis=0), 1.0, _FPROP_DIMS, static.out_dtype)
    return y, (x, w)


def _mxfp4_bwd(static: _Static, res, g, seen):
    quant = _observed(_mxfp4_operand, health.mxfp4_stats, seen)
    x, w = res
    # DGRAD  dX = dY . W^T: blocks along N, W requantized from high precision.
    dx = _gemm(quant("dy", g, axis=1), quant("w_dgrad", w, axis=1), 1.0, _DGRAD_DIMS, static.x_dtype)
    # WGRAD  dW = X^T . dY: blocks along tokens.
    dw = _gemm(quant("x_wgrad", x, axis=0), quant("dy_wgrad", g, axis=0), 1.0, _WGRAD_DIMS, static.w_dtype)
    return dx, dw, None, None


# --- FP8 (per-tensor, HYBRID) -----------------------------------------------------------------


def _amax(x):
    # An integer max over |x| bits: XLA's float max can drop NaN.
    return F.bits_to_f32(jnp.max(F.abs_bits(x)))


def _fp8_scale(static: _Static, meta, role, amax):
    if static.recipe.fp8_delayed:
        return meta[fp8_delayed.scale_name(role)][0]  # from earlier steps only
    return fp8_delayed.scale_from_amax(amax, fp8_delayed.ROLE_FORMATS[role])[0]


def _fp8_operand(static: _Static, meta, role, x, seen):
    """(FP8 values, fp32 decode scale, amax) of `x` in its role's format."""
    amax = _amax(x)
    fmt = fp8_delayed.ROLE_FORMATS[role]
    scale = _fp8_scale(static, meta, role, amax)
    q = quantize_fp8(x, scale, fmt)
    if seen is not None:
        seen[role] = health.fp8_stats(x, q.data, scale, q.scale_inv, fmt)
    return q.data, q.scale_inv, amax


def _fp8_fwd(static: _Static, x, w, meta, seen):
    xq, dec_x, amax_x = _fp8_operand(static, meta, "x", x, seen)
    wq, dec_w, amax_w = _fp8_operand(static, meta, "w", w, seen)
    # FPROP  Y = X . W: both E4M3.
    y = _gemm(xq, wq, dec_x * dec_w, _FPROP_DIMS, static.out_dtype)
    # Per-tensor scales make every quantized tensor its own transpose: the backward reuses the
    # forward's FP8 X and W (one byte per element).
    state = (meta, amax_x, amax_w) if static.recipe.fp8_delayed else None
    return y, (xq, dec_x, wq, dec_w, state)


def _fp8_bwd(static: _Static, res, g, seen):
    xq, dec_x, wq, dec_w, state = res
    meta = state[0] if state is not None else None
    gq, dec_g, amax_g = _fp8_operand(static, meta, "dy", g, seen)
    # DGRAD  dX = dY . W^T: E5M2 x E4M3.
    dx = _gemm(gq, wq, dec_g * dec_w, _DGRAD_DIMS, static.x_dtype)
    # WGRAD  dW = X^T . dY: E4M3 x E5M2.
    dw = _gemm(xq, gq, dec_x * dec_g, _WGRAD_DIMS, static.w_dtype)
    next_meta = None
    if state is not None:
        # Overwrite-with-gradient: the cotangent of this step's state is the next state.
        meta, amax_x, amax_w = state
        next_meta = fp8_delayed.next_fp8_meta(
            meta, {"x": amax_x, "w": amax_w, "dy": amax_g}, margin=static.recipe.margin
        )
    return dx, dw, None, next_meta
