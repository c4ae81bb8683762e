"""Quantization health: what quantizing each GEMM operand did to it.

For one operand tensor `x` and its quantized-then-dequantized copy `Q(x)` (both in the
quantization domain: after the RHT for the RHT copies), the statistics are

- `amax`: max |x|, the tensor amax the per-tensor scale comes from;
- `error`: ||Q(x) - x|| / ||x|| (0 for an all-zero tensor);
- `zero_frac`: of the non-zero values of x, the fraction whose Q(x) is 0;

and for NVFP4, of all the tensor's scaling blocks (16 values, or 16x16 weight tiles), the
fraction whose E4M3 block scale

- `scale_zero_frac`: underflows to 0 although the block holds a non-zero value (the whole block
  is lost);
- `scale_subnormal_frac`: is an E4M3 subnormal (below 2**-6: fewer significant bits);
- `scale_max_frac`: is 448, the largest E4M3 value. Under the per-tensor scale a block reaches
  448 only when its amax lies within the top E4M3 step of the tensor amax (above ~432/448 of
  it), so this is the share of blocks that sit at the tensor's peak;

and for FP8 (per-tensor scale, no blocks) `saturated_frac`: the fraction of values beyond the
format's largest value, clipped to it (delayed scaling's failure mode: the scale comes from
earlier steps' amaxes).

The quantized dot computes these from the very arguments it quantizes with (`dot.py`), and only
when it is handed a statistics pytree (`init_stats`): the Flax module keeps that pytree in the
variable collection `COLLECTION`, and the gradient with respect to it is the statistics (see
`nvfp4_jax.train.step.make_quant_stats_step`). Without it nothing here runs.

Operand names (one GEMM of the layer `Y = X . W` each): "x", "w" (FPROP), "dy" and, where the
weight is requantized for DGRAD, "w_dgrad" (DGRAD), "x_wgrad", "dy_wgrad" (WGRAD: the RHT copies
under an RHT recipe). FP8 quantizes X, W, dY once: "x", "w", "dy".
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from . import formats as F
from .fp8 import FP8_MAX
from .hadamard import random_hadamard_transform
from .mxfp4 import dequantize_mxfp4, quantize_mxfp4_spec
from .nvfp4 import quantize_blocks
from .recipe import Recipe, operand_specs
from .spec import OperandSpec

COLLECTION = "quant_stats"

VALUE_STATS = ("amax", "error", "zero_frac")
NVFP4_SCALE_STATS = ("scale_zero_frac", "scale_subnormal_frac", "scale_max_frac")
FP8_STATS = ("saturated_frac",)
# Smallest normal E4M3 value: block scales below it are subnormal.
E4M3_MIN_NORMAL = 2.0**-6

Stats = dict[str, jax.Array]


def operands(recipe: Recipe) -> tuple[str, ...]:
    """The names of the operands `recipe`'s quantized GEMMs quantize (see the module doc)."""
    return tuple(role for role, spec in operand_specs(recipe).items() if spec is not None)


def stat_names(recipe: Recipe) -> tuple[str, ...]:
    """The statistics each operand of `recipe` gets."""
    extra = {"nvfp4": NVFP4_SCALE_STATS, "fp8": FP8_STATS}.get(recipe.format, ())
    return VALUE_STATS + extra


def init_stats(recipe: Recipe) -> dict[str, Stats]:
    """The zero statistics pytree of one quantized GEMM: `{operand: {stat: f32 scalar}}`."""
    if recipe.is_bf16:
        raise ValueError("a BF16 GEMM quantizes nothing and has no quantization statistics")
    return {op: {s: jnp.zeros((), jnp.float32) for s in stat_names(recipe)} for op in operands(recipe)}


def _fraction(mask: jax.Array, total) -> jax.Array:
    return jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32) / jnp.float32(total)


def value_stats(x: jax.Array, q: jax.Array) -> Stats:
    """`amax`, `error` and `zero_frac` of a tensor `x` and its dequantized copy `q` (same shape)."""
    x = x.astype(jnp.float32)
    q = q.astype(jnp.float32)
    amax = F.bits_to_f32(jnp.max(F.abs_bits(x)))
    # Relative to amax so the squares can neither overflow nor underflow.
    unit = jnp.where(amax > 0, amax, 1.0)
    norm = jnp.sqrt(jnp.sum(jnp.square(x / unit)))
    diff = jnp.sqrt(jnp.sum(jnp.square((q - x) / unit)))
    nonzero = x != 0
    count = jnp.sum(nonzero, dtype=jnp.int32)
    lost = jnp.sum(nonzero & (q == 0), dtype=jnp.int32)
    return {
        "amax": amax,
        "error": jnp.where(norm > 0, diff / norm, 0.0),
        "zero_frac": jnp.where(count > 0, lost.astype(jnp.float32) / jnp.maximum(count, 1), 0.0),
    }


def nvfp4_stats(x: jax.Array, *, axis: int = -1, two_d: bool = False, rht: bool = False,
                stochastic: bool = False, key: jax.Array | None = None) -> Stats:
    """The statistics of NVFP4-quantizing `x` with these arguments (those of `nvfp4_gemm_operand`)."""
    spec = OperandSpec(axis=axis, two_d=two_d, rht=rht, stochastic=stochastic)
    return nvfp4_spec_stats(x, spec, key, fn="nvfp4_stats")


def nvfp4_spec_stats(x: jax.Array, spec: OperandSpec, key=None, *, fn: str = "nvfp4_spec_stats") -> Stats:
    """The statistics of NVFP4-quantizing `x` as `spec` says.

    Uses the block quantizer with the same key, so a stochastically rounded operand gets the
    statistics of the very rounding the GEMM saw.
    """
    q = quantize_blocks(x, spec, key, fn=fn)
    if spec.rht:
        x = random_hadamard_transform(x, F.normalize_axis(spec.axis, x.ndim, fn))
    lay = q.lay
    xb = x.astype(jnp.float32).reshape(lay.blocked)
    dq = (F.e2m1_values(q.codes) * q.s_b) * q.decode  # the dequantization of spec section 3
    amax_b_bits, _ = F.block_amax_bits(xb, lay)
    nonzero_block = amax_b_bits.reshape(q.scales.shape) > 0
    s = F.fp8_to_f32(q.scales)
    blocks = q.scales.size
    return {
        **value_stats(xb, dq),
        "scale_zero_frac": _fraction((s == 0) & nonzero_block, blocks),
        "scale_subnormal_frac": _fraction((s > 0) & (s < E4M3_MIN_NORMAL), blocks),
        "scale_max_frac": _fraction(s == F.E4M3_MAX, blocks),
    }


def mxfp4_stats(x: jax.Array, *, axis: int, two_d: bool = False, rht: bool = False,
                stochastic: bool = False, key: jax.Array | None = None) -> Stats:
    """The statistics of MXFP4-quantizing `x` with these arguments (those of `quantize_mxfp4`)."""
    spec = OperandSpec(axis=axis, two_d=two_d, rht=rht, stochastic=stochastic)
    return mxfp4_spec_stats(x, spec, key, fn="mxfp4_stats")


def mxfp4_spec_stats(x: jax.Array, spec: OperandSpec, key=None, *, fn: str = "mxfp4_spec_stats") -> Stats:
    """The statistics of MXFP4-quantizing `x` as `spec` says: the same quantizer and key as the
    GEMM's operand, compared in the rotated domain for an RHT copy (as NVFP4's)."""
    q = quantize_mxfp4_spec(x, spec, key, fn=fn)
    if spec.rht:
        x = random_hadamard_transform(x, q.axis)
    return value_stats(x, dequantize_mxfp4(q))


def fp8_stats(x: jax.Array, data: jax.Array, scale: jax.Array, scale_inv: jax.Array, fmt: str) -> Stats:
    """The statistics of FP8 data `data` (decode factor `scale_inv`) made from `x` with `scale`."""
    q = data.astype(jnp.float32) * scale_inv
    scaled = jnp.abs(x.astype(jnp.float32) * scale)
    return {**value_stats(x, q), "saturated_frac": _fraction(scaled > FP8_MAX[fmt], x.size)}


def check_stats(stats: Any, recipe: Recipe, where: str) -> None:
    """Raises ValueError unless `stats` has the structure of `init_stats(recipe)`."""
    want = jax.tree.structure(jax.eval_shape(lambda: init_stats(recipe)))
    got = jax.tree.structure(stats)
    if got != want:
        raise ValueError(f"{where}: quant_stats must have the structure of init_stats(recipe) = {want}; got {got}")


# --- reading the collected statistics -----------------------------------------------------------


def _is_stats(node: Any) -> bool:
    return isinstance(node, Mapping) and bool(node) and all(
        isinstance(v, Mapping) and v and all(not isinstance(s, Mapping) for s in v.values())
        for v in node.values()
    )


def flatten(tree: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """The collection `COLLECTION` as `{projection: {operand: {stat: float}}}`.

    A projection is named by its module path without the dot module itself, e.g.
    "layers_1/mlp/gate". Statistics stacked along leading axes (layers under `nn.scan`: a
    variable of shape [L]) are split into one projection each, named "path[i]" (or "path[i,j]").
    """
    out: dict[str, dict[str, dict[str, float]]] = {}

    def visit(node: Mapping[str, Any], path: tuple[str, ...]) -> None:
        if _is_stats(node):
            label = "/".join(path[:-1]) or path[-1]
            arrays = {op: {s: np.asarray(v) for s, v in stats.items()} for op, stats in node.items()}
            shape = next(iter(next(iter(arrays.values())).values())).shape
            for index in np.ndindex(*shape):
                name = f"{label}[{','.join(map(str, index))}]" if index else label
                out[name] = {
                    op: {s: float(v[index]) for s, v in stats.items()} for op, stats in arrays.items()
                }
            return
        for key, child in node.items():
            if isinstance(child, Mapping):
                visit(child, path + (str(key),))

    visit(tree, ())
    return out


_LAYER = re.compile(r"(?:layers_|\[)(\d+)")


def layer_index(projection: str) -> int | None:
    """The decoder layer a flattened projection name belongs to ("layers_3/..." or "...[3]")."""
    match = _LAYER.search(projection)
    return int(match.group(1)) if match else None
