"""The LM head's logits and the next-token cross-entropy, whole or a tile of the sequence at a time.

`V` fp32 logits per token are the largest activation of a Llama step (128256 for Llama 3: 0.5 MiB
a token, 16 GiB for 32k tokens, as much again for their gradient). With `num_tiles > 1` the loss
computes the logits of `L / num_tiles` positions at a time, with the LM head inside the tile, and
`jax.checkpoint` recomputes them in the backward pass, so only one tile's logits (and gradient)
are ever live.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from nvfp4_jax.model.layers import BLV, constrain, kernel_init

_HEAD_DIMS = (((2,), (0,)), ((), ()))  # h[B, L, D] . kernel[D, V]


def head_logits(h_BxLxD: jax.Array, kernel_DxV: jax.Array, dtype: Any) -> jax.Array:
    """fp32 logits of the LM head: operands in `dtype`, fp32 accumulation and output."""
    logits_BxLxV = jax.lax.dot_general(
        h_BxLxD.astype(dtype), kernel_DxV.astype(dtype), _HEAD_DIMS, preferred_element_type=jnp.float32
    )
    return constrain(logits_BxLxV, BLV)


def _loss_sum(h_BxLxD, kernel_DxV, targets_BxL, weights_BxL, dtype) -> jax.Array:
    losses_BxL = optax.softmax_cross_entropy_with_integer_labels(
        head_logits(h_BxLxD, kernel_DxV, dtype), targets_BxL
    )
    if weights_BxL is None:
        return losses_BxL.sum()
    # where, not only a product: a zero-weight token's loss never reaches the sum, even if inf.
    return jnp.where(weights_BxL != 0, losses_BxL * weights_BxL, 0.0).sum()


def cross_entropy_sum(
    h_BxLxD: jax.Array, kernel_DxV: jax.Array, targets_BxL: jax.Array, dtype: Any, num_tiles: int = 1,
    weights_BxL: jax.Array | None = None,
) -> jax.Array:
    """Sum over tokens of `weight * -log softmax(h . kernel)[target]`, in fp32.

    `weights_BxL` (fp32; None: every token weighs 1) is the loss mask of padded or packed
    batches. `num_tiles` must divide L. Tiles split the sequence axis, so each tile keeps the
    batch split the activations have; the kernel's gradient accumulates over tiles in fp32.
    """
    if weights_BxL is not None:
        weights_BxL = weights_BxL.astype(jnp.float32)
    if num_tiles == 1:
        return _loss_sum(h_BxLxD, kernel_DxV, targets_BxL, weights_BxL, dtype)
    B, L, D = h_BxLxD.shape
    if L % num_tiles:
        raise ValueError(f"num_vocab_tiling={num_tiles} must divide the sequence length {L}")
    T = L // num_tiles
    h_NxBxTxD = h_BxLxD.reshape(B, num_tiles, T, D).swapaxes(0, 1)
    targets_NxBxT = targets_BxL.reshape(B, num_tiles, T).swapaxes(0, 1)
    weights_NxBxT = None if weights_BxL is None else weights_BxL.reshape(B, num_tiles, T).swapaxes(0, 1)
    # The fp32 kernel enters every tile (cast inside), so its per-tile gradients add in fp32.
    tile_loss = jax.checkpoint(_loss_sum, static_argnums=(4,))

    def body(total, tile):
        h_BxTxD, targets_BxT, weights_BxT = tile
        return total + tile_loss(h_BxTxD, kernel_DxV, targets_BxT, weights_BxT, dtype), None

    total, _ = jax.lax.scan(
        body, jnp.zeros((), jnp.float32), (h_NxBxTxD, targets_NxBxT, weights_NxBxT))
    return total


class LMHead(nn.Module):
    """The `[D, V]` fp32 output projection: logits, or the loss computed tile by tile."""

    vocab_size: int
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, h_BxLxD: jax.Array, targets_BxL: jax.Array | None = None, num_tiles: int = 1,
                 weights_BxL: jax.Array | None = None):
        """fp32 logits `[B, L, V]`; with `targets_BxL`, the (weighted) summed cross-entropy instead."""
        kernel_DxV = self.param(
            "kernel", nn.with_logical_partitioning(kernel_init, ("embed", "vocab")),
            (h_BxLxD.shape[-1], self.vocab_size), jnp.float32,
        )
        if targets_BxL is None:
            return head_logits(h_BxLxD, kernel_DxV, self.dtype)
        return cross_entropy_sum(h_BxLxD, kernel_DxV, targets_BxL, self.dtype, num_tiles, weights_BxL)
