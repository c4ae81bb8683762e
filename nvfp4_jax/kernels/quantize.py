"""Fused NVFP4 quantization kernels (Pallas): bit-exact to `nvfp4_jax.quant`, one read per pass.

A 2-D tensor X [M, N] (float32 or bfloat16, M and N multiples of 16) is quantized in two
passes over memory, the least a quantizer with a per-tensor scale can do:

1. `_amax_kernel` reads X once and reduces, per tile, the |X| bits and (when a copy needs it)
   the bits of |RHT(X)| along M; jnp finishes the max over the few tiles.
2. jnp computes each copy's per-tensor factors exactly as the reference does
   (`nvfp4.tensor_factors`: integer-built arithmetic and the 128-row table by E4M3 byte).
3. `_quantize_kernel` reads X once more and writes every requested copy: 1x16 blocks along N
   ("rows"), 1x16 blocks along M with or without the RHT ("cols"), 16x16 tiles ("tiles"),
   each rounded to nearest or stochastically, as packed codes + E4M3 scale bytes or as the
   emulated GEMM's operand (bf16 values `e2m1 * s_b`). The backward pass's two copies of dY
   (rows with SR for DGRAD, cols with RHT and SR for WGRAD) come from one read.

A program owns a tile of 16*G rows and BN columns and views it as 16 row slices
(rows k, k+16, k+32, ...): a column's 16-block along M is then one element of each slice, so
the RHT butterfly and the column-block amax are elementwise work across slices, and a row's
16-blocks lie inside one slice. Everything inside is what Triton lowers: strided loads and
stores, reshapes, reductions, a gather from the per-tensor table by scale byte, integer and
float elementwise work. The per-block and per-element arithmetic is the reference's own
functions (`nvfp4.block_scales`, `formats.e2m1_rn_codes`, `round_e2m1_stochastic`,
`e2m1_codes`, `e2m1_values`, the SR noise `sr_noise_groups`); only the RHT butterfly and the
nibble packing are written again here, in the slice layout, because the reference's
concatenates and width-changing bitcasts have no Triton lowering.

`interpret=True` runs the kernels through Pallas's interpreter on any backend (tests, CPU);
otherwise they lower with Triton (NVIDIA GPUs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from nvfp4_jax.quant import exact
from nvfp4_jax.quant import formats as F
from nvfp4_jax.quant import nvfp4
from nvfp4_jax.quant.hadamard import WGRAD_SIGNS

BLOCK = F.NVFP4_BLOCK  # 16
BLOCK_KINDS = ("rows", "cols", "tiles")
# Largest tile (rows, columns) a program takes; both shrink to powers of two dividing M and N.
DEFAULT_TILE = (64, 256)
_NUM_WARPS = 4
_SIGNS_QUARTER = [float(s) / 4.0 for s in WGRAD_SIGNS]


@dataclasses.dataclass(frozen=True)
class Copy:
    """One quantized copy of X [M, N] that `fused_quantize` writes.

    blocks: "rows" (1x16 along N, X's own layout), "cols" (1x16 along M: the WGRAD copy),
        "tiles" (16x16, weights).
    rht: the 16-point RHT along M first ("cols" only); the amax is the rotated tensor's.
    stochastic: 8-bit stochastic rounding with the copy's key (else round to nearest even).
    packed: the storage form (an `NVFP4Tensor`) instead of the GEMM operand form
        `(bf16 values, fp32 decode scale)`.
    """

    blocks: str
    rht: bool = False
    stochastic: bool = False
    packed: bool = False

    def __post_init__(self):
        if self.blocks not in BLOCK_KINDS:
            raise ValueError(f"Copy: blocks={self.blocks!r}; allowed: {', '.join(BLOCK_KINDS)}")
        if self.rht and self.blocks != "cols":
            raise ValueError(f"Copy: rht=True needs blocks='cols' (the RHT runs along M); got {self.blocks!r}")


# --- layout helpers ------------------------------------------------------------------------------


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def tile_for(shape: tuple[int, int], tile: Optional[tuple[int, int]] = None) -> tuple[int, int]:
    """The (rows, columns) tile used for `shape`: powers of two, at least 16, dividing it."""
    cap_m, cap_n = tile or DEFAULT_TILE
    m, n = shape
    bt, bn = _pow2_divisor(m, max(cap_m, BLOCK)), _pow2_divisor(n, max(cap_n, BLOCK))
    if bt < BLOCK or bn < BLOCK:
        raise ValueError(f"fused NVFP4 kernels need M and N multiples of {BLOCK}; got shape {shape}")
    return bt, bn


def _load_slices(x_ref, g: int) -> list[jax.Array]:
    """The tile's 16 row slices (rows k, k+16, ...), each [G, BN] float32."""
    return [x_ref[pl.ds(k, g, stride=BLOCK), :].astype(jnp.float32) for k in range(BLOCK)]


def _rht_slices(xs: list[jax.Array]) -> list[jax.Array]:
    """`hadamard.random_hadamard_transform` along M, on the 16 slices of a tile: bf16 inputs,
    exact products with +-1/4, the butterfly at strides 1, 2, 4, 8 (sum to the lower index),
    bf16 result. The same float32 operations in the same order as the reference."""
    v = [x.astype(jnp.bfloat16).astype(jnp.float32) * s for x, s in zip(xs, _SIGNS_QUARTER)]
    for h in (1, 2, 4, 8):
        for k in range(BLOCK):
            if not k & h:
                v[k], v[k + h] = v[k] + v[k + h], v[k] - v[k + h]
    return [t.astype(jnp.bfloat16).astype(jnp.float32) for t in v]


def _interleave_rows(vs: list[jax.Array]) -> jax.Array:
    """The tile [16 G, BN] whose row 16 g + k is row g of slice k: two-way stacks along a new
    last axis (what Triton joins), then one transpose."""
    g, bn = vs[0].shape
    level = list(vs)
    while len(level) > 1:  # after each round, entry j holds slices j, j + len, j + 2 len, ...
        half = len(level) // 2
        level = [
            jnp.stack([level[j], level[j + half]], axis=-1).reshape(g, bn, -1)
            for j in range(half)
        ]
    return jnp.swapaxes(level[0], 1, 2).reshape(g * BLOCK, bn)


def _rotated_tile(x_ref) -> jax.Array:
    """The [BT, BN] tile after the RHT along M (float32 holding bf16 values)."""
    return _interleave_rows(_rht_slices(_load_slices(x_ref, x_ref.shape[0] // BLOCK)))


def _pack_pairs(codes: jax.Array, axis: int) -> jax.Array:
    """`formats.pack_nibbles` in operations Triton lowers: a shifted sum over each pair."""
    pairs = codes.reshape(F._pair_shape(codes.shape, axis))
    shift = jnp.arange(2, dtype=jnp.uint32) * np.uint32(4)
    shift = shift.reshape((1,) * (axis + 1) + (2,) + (1,) * (codes.ndim - axis - 1))
    return jnp.sum((pairs & np.uint32(0xF)) << shift, axis=axis + 1).astype(jnp.uint8)


# --- the per-copy arithmetic (the reference's functions) ----------------------------------------

# Per-copy scalars, passed as uint32[8]: the per-tensor multipliers' bits, the non-finite flag,
# the SR key words.
_MULT, _MULT_TINY, _NONFINITE, _K0, _K1 = range(5)
_N_SCALARS = 8
_TABLE = 128  # rows of the per-tensor table: one per non-negative E4M3 byte


def _block_factors(amax_b_bits, scal_ref, table_ref):
    """(scale bytes uint8, s_b, enc_b) of blocks with these amax bits (nvfp4.quantize_blocks)."""
    mult, mult_tiny = (exact.from_bits(scal_ref[i]) for i in (_MULT, _MULT_TINY))
    scales = nvfp4.block_scales(F.bits_to_f32(amax_b_bits), mult, mult_tiny)
    byte = lax.bitcast_convert_type(scales, jnp.uint8)
    byte = jnp.where(scal_ref[_NONFINITE] != 0, np.uint8(0x7F), byte)  # NaN scales
    index = byte.astype(jnp.int32)
    return byte, table_ref[index], table_ref[index + _TABLE]


def _element_codes(x, enc_b, rbits):
    y = jnp.clip(x * enc_b, -F.E2M1_MAX, F.E2M1_MAX)
    if rbits is None:
        return F.e2m1_rn_codes(y)
    return F.e2m1_codes(F.round_e2m1_stochastic(y, rbits))


class _Noise:
    """SR noise bytes of the tile, as `formats.stochastic_rounding_bits` draws them for the whole
    [M, N] tensor (element (r, c) is flat index r * N + c), for rows `first + stride * arange`."""

    def __init__(self, scal_ref, n_cols: int, bt: int, bn: int):
        self.k0, self.k1 = scal_ref[_K0], scal_ref[_K1]
        i, j = pl.program_id(0), pl.program_id(1)
        self.row0 = (i * bt).astype(jnp.uint32)
        self.groups_per_row = np.uint32(n_cols // F.SR_GROUP)
        n_groups = bn // F.SR_GROUP
        self.col_groups = (j * n_groups).astype(jnp.uint32) + jnp.arange(n_groups, dtype=jnp.uint32)

    def rows(self, first: int, count: int, stride: int) -> jax.Array:
        """uint32 noise [count, BN] of the tile's rows first, first + stride, ..."""
        rows = self.row0 + np.uint32(first) + jnp.arange(count, dtype=jnp.uint32) * np.uint32(stride)
        groups = rows[:, None] * self.groups_per_row + self.col_groups[None, :]
        noise = F.sr_noise_groups(self.k0, self.k1, groups)
        return noise.reshape(count, self.col_groups.shape[0] * F.SR_GROUP)


def _write_copy(tile, copy, scal_ref, table_ref, outs, noise):
    """One copy of the [BT, BN] tile (rotated for an RHT copy), in the reference's own block
    layout (`formats.block_layout`)."""
    bt, bn = tile.shape
    axis = 0 if copy.blocks == "cols" else 1
    lay = F.block_layout(tile.shape, axis, BLOCK, copy.blocks == "tiles")
    xb = tile.reshape(lay.blocked)
    amax_b = jnp.max(F.abs_bits(xb), axis=lay.reduce_axes, keepdims=True)
    byte, s_b, enc_b = _block_factors(amax_b, scal_ref, table_ref)
    rbits = noise.rows(0, bt, 1).reshape(lay.blocked) if copy.stochastic else None
    codes = _element_codes(xb, enc_b, rbits)
    codes = jnp.where(scal_ref[_NONFINITE] != 0, nvfp4.NONFINITE_CODE, codes)  # as the reference
    if copy.packed:
        outs[0][...] = _pack_pairs(codes.reshape(bt, bn), axis)
        outs[1][...] = byte.reshape(outs[1].shape)
    else:
        outs[0][...] = (F.e2m1_values(codes) * s_b).astype(jnp.bfloat16).reshape(bt, bn)


def _n_outputs(copy: Copy) -> int:
    return 2 if copy.packed else 1


def _quantize_kernel(x_ref, *refs, copies: tuple[Copy, ...], n_cols: int):
    ins, outs = refs[: 2 * len(copies)], refs[2 * len(copies) :]
    bt, bn = x_ref.shape
    # Each read once, and only if a copy needs it: the tile, and the tile rotated along M.
    tile = x_ref[...].astype(jnp.float32) if not all(c.rht for c in copies) else None
    rotated = _rotated_tile(x_ref) if any(c.rht for c in copies) else None
    for c, copy in enumerate(copies):
        scal_ref, table_ref = ins[2 * c], ins[2 * c + 1]
        first = sum(_n_outputs(p) for p in copies[:c])
        copy_outs = outs[first : first + _n_outputs(copy)]
        noise = _Noise(scal_ref, n_cols, bt, bn) if copy.stochastic else None
        _write_copy(rotated if copy.rht else tile, copy, scal_ref, table_ref, copy_outs, noise)


def _amax_kernel(x_ref, plain_ref, rht_ref, *, with_rht: bool):
    plain_ref[...] = jnp.max(F.abs_bits(x_ref[...]))
    if with_rht:
        rht_ref[...] = jnp.max(F.abs_bits(_rotated_tile(x_ref)))
    else:
        rht_ref[...] = jnp.uint32(0)


# --- pallas_call wrappers ------------------------------------------------------------------------


def _default_interpret() -> bool:
    return jax.default_backend() != "gpu"


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret: bool, name: str):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=_NUM_WARPS),
        name=name,
    )


def tile_amax_bits(x: jax.Array, *, with_rht: bool, tile=None, interpret: Optional[bool] = None):
    """(|X| amax bits, |RHT along M of X| amax bits or 0) of 2-D x, as uint32 scalars: one read."""
    interpret = _default_interpret() if interpret is None else interpret
    bt, bn = tile_for(x.shape, tile)
    grid = (x.shape[0] // bt, x.shape[1] // bn)
    partial_spec = pl.BlockSpec((None, None), lambda i, j: (i, j))
    partial = jax.ShapeDtypeStruct(grid, jnp.uint32)
    plain, rht = _call(
        functools.partial(_amax_kernel, with_rht=with_rht),
        grid,
        [pl.BlockSpec((bt, bn), lambda i, j: (i, j))],
        [partial_spec, partial_spec],
        [partial, partial],
        interpret,
        "nvfp4_amax",
    )(x)
    return jnp.max(plain), jnp.max(rht)


def _out_specs(copy: Copy, shape, bt: int, bn: int):
    """(BlockSpecs, ShapeDtypeStructs) of one copy's outputs."""
    m, n = shape
    at = lambda i, j: (i, j)  # noqa: E731
    if not copy.packed:
        return [pl.BlockSpec((bt, bn), at)], [jax.ShapeDtypeStruct((m, n), jnp.bfloat16)]
    if copy.blocks == "cols":
        codes = ((bt // 2, bn), (m // 2, n))
        scales = ((bt // BLOCK, bn), (m // BLOCK, n))
    else:
        codes = ((bt, bn // 2), (m, n // 2))
        rows = bt // BLOCK if copy.blocks == "tiles" else bt
        scales = ((rows, bn // BLOCK), (m // (BLOCK if copy.blocks == "tiles" else 1), n // BLOCK))
    specs = [pl.BlockSpec(codes[0], at), pl.BlockSpec(scales[0], at)]
    return specs, [jax.ShapeDtypeStruct(codes[1], jnp.uint8), jax.ShapeDtypeStruct(scales[1], jnp.uint8)]


def _tensor_inputs(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(scalars uint32[3], table float32[256]) of one amax: the reference's per-tensor factors."""
    f = nvfp4.tensor_factors(amax)
    nonfinite = jnp.isnan(amax).astype(jnp.uint32)
    scalars = jnp.stack([exact.bits(f.mult), exact.bits(f.mult_tiny), nonfinite])
    return scalars, jnp.concatenate([f.table[:, 0], f.table[:, 1]])


def _copy_scalars(tensor_scalars: jax.Array, key) -> jax.Array:
    """A copy's uint32[8] scalars: its tensor's, then its SR key words."""
    k0, k1 = F.sr_key_words(key) if key is not None else (jnp.uint32(0), jnp.uint32(0))
    scalars = jnp.concatenate([tensor_scalars, jnp.stack([k0, k1])])
    return jnp.concatenate([scalars, jnp.zeros(_N_SCALARS - scalars.shape[0], jnp.uint32)])


def _amax_from_bits(bits: jax.Array) -> jax.Array:
    # As the reference: NaN when any element (after the RHT) is NaN or Inf.
    return jnp.where(F.is_nonfinite_bits(bits), jnp.float32(jnp.nan), F.bits_to_f32(bits))


def fused_quantize(
    x: jax.Array,
    copies: Sequence[Copy],
    keys: Sequence[Optional[jax.Array]] = (),
    *,
    tile: Optional[tuple[int, int]] = None,
    interpret: Optional[bool] = None,
) -> list:
    """Quantize 2-D `x` into every copy of `copies` with two reads of x (amax, then encode).

    keys: one PRNG key per copy (None for round-to-nearest copies); default all None.
    tile: the largest (rows, columns) tile per program (default `DEFAULT_TILE`).
    interpret: run the kernels in Pallas's interpreter (default: unless JAX's default backend
        is a GPU).
    Returns, per copy, an `NVFP4Tensor` (packed) or `(bf16 values [M, N], decode scale)`,
    bit for bit what `quantize_nvfp4` / `nvfp4_gemm_operand` return for the same arguments:
    rows = `axis=1`, cols = `axis=0` (with `rht`), tiles = `two_d=True`.
    """
    copies = tuple(copies)
    keys = tuple(keys) or (None,) * len(copies)
    if x.ndim != 2 or len(keys) != len(copies):
        raise ValueError(
            f"fused_quantize: x must be 2-D with one key per copy; got x.shape={x.shape}, "
            f"{len(copies)} copies and {len(keys)} keys"
        )
    F.check_float(x, "fused_quantize")
    for copy, key in zip(copies, keys):
        if copy.stochastic and key is None:
            raise ValueError(f"fused_quantize: {copy} rounds stochastically and needs a key; got None")
    if x.size // F.SR_GROUP > F._MAX_SR_GROUPS:
        raise ValueError(f"fused_quantize: x has {x.size} elements; SR counters allow at most {F.SR_GROUP * F._MAX_SR_GROUPS}")
    interpret = _default_interpret() if interpret is None else interpret
    bt, bn = tile_for(x.shape, tile)
    plain_bits, rht_bits = tile_amax_bits(
        x, with_rht=any(c.rht for c in copies), tile=tile, interpret=interpret
    )
    # The per-tensor factors once per amax (the rotated tensor's or the plain one's).
    amax_of = {rht: _amax_from_bits(rht_bits if rht else plain_bits) for rht in {c.rht for c in copies}}
    tensor_inputs = {rht: _tensor_inputs(amax) for rht, amax in amax_of.items()}
    amaxes = [amax_of[c.rht] for c in copies]

    inputs, in_specs, out_specs, out_shape = [x], [pl.BlockSpec((bt, bn), lambda i, j: (i, j))], [], []
    whole = lambda n: pl.BlockSpec((n,), lambda i, j: (0,))  # noqa: E731
    for copy, key in zip(copies, keys):
        tensor_scalars, table = tensor_inputs[copy.rht]
        inputs += [_copy_scalars(tensor_scalars, key if copy.stochastic else None), table]
        in_specs += [whole(_N_SCALARS), whole(2 * _TABLE)]
        specs, shapes = _out_specs(copy, x.shape, bt, bn)
        out_specs += specs
        out_shape += shapes
    outs = _call(
        functools.partial(_quantize_kernel, copies=copies, n_cols=x.shape[1]),
        (x.shape[0] // bt, x.shape[1] // bn),
        in_specs,
        out_specs,
        out_shape,
        interpret,
        "nvfp4_quantize",
    )(*inputs)

    results, pos = [], 0
    for copy, amax in zip(copies, amaxes):
        mine = outs[pos : pos + _n_outputs(copy)]
        pos += len(mine)
        if copy.packed:
            results.append(
                nvfp4.NVFP4Tensor(
                    codes=mine[0],
                    scales=lax.bitcast_convert_type(mine[1], jnp.float8_e4m3fn),
                    amax=amax,
                    shape=tuple(x.shape),
                    axis=0 if copy.blocks == "cols" else 1,
                    two_d=copy.blocks == "tiles",
                    rht=copy.rht,
                )
            )
        else:
            results.append((mine[0], nvfp4.decode_scale(amax)))
    return results
