"""One block-scaled FP4 tensor type: the storage form of NVFP4 and MXFP4 (a JAX pytree).

Both formats store E2M1 codes, two per byte along the block axis, and one scale per block (a 1-D
block along `axis`, or a square tile of a 2-D weight); they differ only in the block size, the
scale's type and how a block's scale (and NVFP4's per-tensor amax) turn codes into values. So
one class holds the fields, the layout and the dequantization's shape work, and each format
(`nvfp4.NVFP4Tensor`, `mxfp4.MXFP4Tensor`) says only its block size and its `scale_blocks`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from . import formats as F
from .spec import OperandSpec


@dataclasses.dataclass(frozen=True)
class BlockScaledTensor:
    """A block-scaled FP4 tensor (metadata fields are static).

    codes:  uint8, two E2M1 codes per byte along `axis` (element 2i in the low nibble);
            `shape` with `shape[axis]` halved.
    scales: one per block (the format's scale type); 1-D blocks: `shape` with `shape[axis]`
            divided by the block size; tiles: `(M // block, N // block)`.
    shape:  the logical (unpacked) shape. axis: the packing/block axis (non-negative; the last
            axis for tiles). two_d: square tiles. rht: the values are in the rotated domain.
    amax:   the float32 per-tensor amax of a two-level format (NVFP4: after the RHT when
            `rht`; NaN when the input was not finite); None for a format without one (MXFP4).
    """

    codes: jax.Array
    scales: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    two_d: bool = dataclasses.field(default=False, metadata=dict(static=True))
    rht: bool = dataclasses.field(default=False, metadata=dict(static=True))
    amax: jax.Array | None = None

    BLOCK: ClassVar[int]  # elements per block (the tile's side for 2-D weights)

    def layout(self) -> F.BlockLayout:
        return F.block_layout(self.shape, self.axis, self.BLOCK, self.two_d)

    def unpack_codes(self) -> jax.Array:
        """The E2M1 codes (uint8, 0..15) in the logical shape."""
        return F.unpack_nibbles(self.codes, self.axis)

    def scale_blocks(self, values_blocked: jax.Array, scales_keepdims: jax.Array) -> jax.Array:
        """The float32 values of the blocks: E2M1 values (blocked layout) times their scales."""
        raise NotImplementedError

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The tensor's values (in the rotated domain when `rht`); NaN where it was not finite."""
        lay = self.layout()
        values = F.e2m1_values(self.unpack_codes()).reshape(lay.blocked)
        return self.scale_blocks(values, self.scales.reshape(lay.keepdims)).reshape(self.shape).astype(dtype)

    @classmethod
    def from_codes(cls, codes: jax.Array, scales: jax.Array, spec: OperandSpec, amax=None):
        """The storage form of E2M1 `codes` (uint, 0..15, the logical shape) and their block
        `scales` (`scale_shape`), quantized as `spec` says (its axis normalized, as the format's
        argument check returns it)."""
        shape = tuple(codes.shape)
        axis = len(shape) - 1 if spec.two_d else F.normalize_axis(spec.axis, len(shape), cls.__name__)
        return cls(codes=F.pack_nibbles(codes, axis), scales=scales, shape=shape, axis=axis,
                   two_d=spec.two_d, rht=spec.rht, amax=amax)


def register(cls: type) -> type:
    """Make a format's tensor class a JAX pytree (data: codes, scales, amax)."""
    jax.tree_util.register_dataclass(
        cls, data_fields=["codes", "scales", "amax"], meta_fields=["shape", "axis", "two_d", "rht"])
    return cls
