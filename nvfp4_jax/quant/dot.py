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

What an NVFP4 backend varies is two small functions, bundled as an
`NVFP4Backend`:

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

Stochastic-rounding keys: the caller passes one key per step and layer (`QuantDotGeneral`
draws it from the "quant" rng stream); the DGRAD and WGRAD copies of dY get
`fold_in(key, 0)` and `fold_in(key, 1)`.

Quantization statistics (`health`): handed a zero statistics pytree, the dot also measures every
operand it quantizes, with the same spec and key, and returns the measurements as that pytree's
cotangent. Without one (the default) the computation is exactly the plain GEMMs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, Optional

import jax
import jax.numpy as jnp
from jax import lax

from nvfp4_jax.quant import formats as F
from nvfp4_jax.quant import fp8_delayed, health
from nvfp4_jax.quant.fp8 import quantize_fp8
from nvfp4_jax.quant.mxfp4 import quantize_mxfp4_spec
from nvfp4_jax.quant.nvfp4 import dequantize, gemm_operand, gemm_operand_group
from nvfp4_jax.quant.recipe import Recipe, get_recipe, operand_specs, recipe_name
from nvfp4_jax.quant.spec import OperandSpec

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


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the custom VJP needs that is not an array (hashable: a nondiff argument)."""

    quantizers: "Quantizers"
    w_cast: Any  # the dtype W is quantized from (None: as given)
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
    kernel_dtype: Any = None,
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
    recipe = get_recipe(recipe)
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


def _gemm(a, b, alpha, dims, out_dtype):
    """bf16 x bf16 products accumulated in fp32, times alpha in fp32, rounded to out_dtype."""
    acc = lax.dot_general(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dims, preferred_element_type=jnp.float32
    )
    return (acc * alpha).astype(out_dtype)


# --- the quantizer sets: what each format provides to the skeleton ------------------------------


@dataclasses.dataclass(frozen=True)
class Quantizers:
    """One format's quantizer set (hashable: part of the custom VJP's static argument).

    The skeleton asks it for the recipe's operand specs (`recipe.operand_specs`: None means the
    backward reuses a forward quantization), to quantize an operand for its spec, to measure
    one (`health`), to run a GEMM on two of its operands, and for the next state of a stateful
    recipe. `aux` is the per-call input the operands need: the SR key (NVFP4) or the amax
    history (delayed FP8).
    """

    recipe: Recipe

    @property
    def specs(self) -> dict:
        return operand_specs(self.recipe)

    def aux(self, key, meta):
        return None

    def quantize(self, x, spec: OperandSpec, aux):
        raise NotImplementedError

    def quantize_group(self, items: list, aux) -> list:
        """The `(spec, x)` operands of one pass, quantized (each on its own unless the format
        can do better)."""
        return [self.quantize(x, spec, aux) for spec, x in items]

    def measure(self, x, spec: OperandSpec, aux):
        raise NotImplementedError

    def gemm(self, a, b, dims, out_dtype):
        raise NotImplementedError

    def state_inputs(self, operands: dict):
        """What the state update needs of the forward's operands (kept for the backward)."""
        return None

    def next_state(self, aux, operands: dict):
        return None


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizers(Quantizers):
    """NVFP4: operands and GEMM from the backend; SR keys folded per dY copy."""

    backend: NVFP4Backend = None  # type: ignore[assignment]

    def aux(self, key, meta):
        return key

    def quantize(self, x, spec, key):
        return self.backend.operand(x, spec, _sr_key(spec, key))

    def quantize_group(self, items, key):
        return self.backend.group([(x, spec, _sr_key(spec, key)) for spec, x in items])

    def measure(self, x, spec, key):
        return health.nvfp4_spec_stats(x, spec, _sr_key(spec, key))

    def gemm(self, a, b, dims, out_dtype):
        return self.backend.gemm(a, b, dims, out_dtype)


@dataclasses.dataclass(frozen=True)
class MXFP4Quantizers(Quantizers):
    """MXFP4: E2M1 times a power of two, exact in bf16 (outside the far ends of the E8M0
    range); no per-tensor scale. The spec's 2-D tiles, RHT and SR are honoured as NVFP4's are,
    with the same per-copy SR keys (`mxfp4_nvfp4_recipe`)."""

    def aux(self, key, meta):
        return key

    def quantize(self, x, spec, key):
        return dequantize(quantize_mxfp4_spec(x, spec, _sr_key(spec, key)), jnp.bfloat16)

    def measure(self, x, spec, key):
        return health.mxfp4_spec_stats(x, spec, _sr_key(spec, key))

    def gemm(self, a, b, dims, out_dtype):
        return _gemm(a, b, 1.0, dims, out_dtype)


@dataclasses.dataclass(frozen=True)
class FP8Quantizers(Quantizers):
    """Per-tensor FP8 (HYBRID: E4M3 X and W, E5M2 dY). An operand is (FP8 values, fp32 decode
    scale, amax); delayed scaling takes the scale from the history and returns the next one."""

    def aux(self, key, meta):
        return meta

    def _scale(self, role, amax, meta):
        if self.recipe.fp8_delayed:
            return meta[fp8_delayed.scale_name(role)][0]  # from earlier steps only
        return fp8_delayed.scale_from_amax(amax, fp8_delayed.ROLE_FORMATS[role])[0]

    def _quantize(self, x, spec, meta):
        amax = _amax(x)
        fmt = fp8_delayed.ROLE_FORMATS[spec.role]
        scale = self._scale(spec.role, amax, meta)
        return quantize_fp8(x, scale, fmt), scale, amax, fmt

    def quantize(self, x, spec, meta):
        q, _, amax, _ = self._quantize(x, spec, meta)
        return q.data, q.scale_inv, amax

    def measure(self, x, spec, meta):
        q, scale, _, fmt = self._quantize(x, spec, meta)
        return health.fp8_stats(x, q.data, scale, q.scale_inv, fmt)

    def gemm(self, a, b, dims, out_dtype):
        (a_data, a_decode, _), (b_data, b_decode, _) = a, b
        return _gemm(a_data, b_data, a_decode * b_decode, dims, out_dtype)

    def state_inputs(self, operands):
        return operands if self.recipe.fp8_delayed else None

    def next_state(self, meta, operands):
        amaxes = {role: op[2] for role, op in operands.items()}
        return fp8_delayed.next_fp8_meta(meta, amaxes, margin=self.recipe.margin)


def _amax(x):
    # An integer max over |x| bits: XLA's float max can drop NaN.
    return F.bits_to_f32(jnp.max(F.abs_bits(x)))


_SR_FOLD = {"dy": SR_DGRAD, "dy_wgrad": SR_WGRAD}


def _sr_key(spec: OperandSpec, key):
    """The stochastic-rounding key of one operand: the step's key folded with its dY copy's
    constant (`sr_keys`); None for an operand that rounds to nearest."""
    return jax.random.fold_in(key, _SR_FOLD[spec.role]) if spec.stochastic else None


def quantizers(recipe: Recipe, backend: NVFP4Backend = None) -> Quantizers:
    """The quantizer set of a quantized `recipe` (NVFP4 operands and GEMMs by `backend`)."""
    if recipe.format == "nvfp4":
        return NVFP4Quantizers(recipe, backend or EMULATED)
    if recipe.format == "mxfp4":
        return MXFP4Quantizers(recipe)
    if recipe.format == "fp8":
        return FP8Quantizers(recipe)
    raise ValueError(f"{recipe_name(recipe)} quantizes nothing: it has no quantizer set")
