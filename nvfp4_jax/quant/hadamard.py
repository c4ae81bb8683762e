"""The 16-point Random Hadamard Transform (RHT) of NVFP4's WGRAD operands (spec section 5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

RHT_SIZE = 16
# Fixed signs, the same for every layer, tensor and step (TE: get_wgrad_sign_vector).
WGRAD_SIGNS = np.array(
    [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float32
)


def _hadamard_np() -> np.ndarray:
    i = np.arange(RHT_SIZE)
    popcount = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    h16 = np.where(popcount % 2 == 0, 1.0, -1.0).astype(np.float32)  # Sylvester order
    return (WGRAD_SIGNS[:, None] * h16 / 4.0).astype(np.float32)


_R = _hadamard_np()
_SIGNS_QUARTER = (WGRAD_SIGNS / 4.0).astype(np.float32)


def hadamard_matrix(dtype=jnp.float32) -> jax.Array:
    """R = diag(signs) @ H16 / 4: orthogonal, entries +-0.25 (exact in bf16)."""
    return jnp.asarray(_R, dtype)


def _blocks(x: jax.Array, axis: int) -> tuple[int, int, int]:
    """(pre, blocks, post): x viewed as [pre, blocks, 16, post] along `axis`; checks the length."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % RHT_SIZE:
        raise ValueError(
            f"random_hadamard_transform: axis {axis} has length {n}; it must be a multiple of "
            f"{RHT_SIZE}"
        )
    pre = int(np.prod(x.shape[:axis], dtype=np.int64))
    post = int(np.prod(x.shape[axis + 1 :], dtype=np.int64))
    return pre, n // RHT_SIZE, post


def random_hadamard_transform(x: jax.Array, axis: int = -1) -> jax.Array:
    """Rotate each block of 16 along `axis` by R, as Blackwell's RHT does.

    Input cast to bf16, exact products with R's entries (+-1/4), sums in fp32, result rounded
    to bf16. The sums run in a fixed order, the fast Walsh-Hadamard butterfly: four stages of
    pairwise sums and differences (strides 1, 2, 4, 8), each an IEEE float32 add that every
    backend rounds alike; a dot_general would leave the accumulation order (and so the last
    bit, when a partial sum rounds) to the backend. When no partial sum rounds, as for most
    blocks of bf16 data, the result is the exact product rounded once to bf16.
    Returns bfloat16 of x's shape.
    """
    pre, blocks, post = _blocks(x, axis)
    # Block element k = 8*k3 + 4*k2 + 2*k1 + k0 sits at index (k3, k2, k1, k0) of axes 2..5.
    v = x.astype(jnp.bfloat16).astype(jnp.float32).reshape(pre, blocks, 2, 2, 2, 2, post)
    v = v * _SIGNS_QUARTER.reshape(1, 1, 2, 2, 2, 2, 1)  # diag(s) / 4: exact
    for bit_axis in (5, 4, 3, 2):  # strides 1, 2, 4, 8
        v = _butterfly_stage(v, bit_axis, contiguous_blocks=post == 1)
    return v.reshape(x.shape).astype(jnp.bfloat16)


def _butterfly_stage(v: jax.Array, bit_axis: int, contiguous_blocks: bool) -> jax.Array:
    """(a, b) -> (a + b, a - b) for the pairs along the size-2 `bit_axis`.

    Two formulations of the same IEEE adds, chosen for how XLA:CPU vectorizes them: with other
    elements between a block's (blocks along a major axis, as the WGRAD copies' token axis),
    `+-v + reversed(v)` (a - b computed as -b + a: the same float) is one select-free loop;
    with contiguous blocks, slices and a concatenate are faster.
    """
    if contiguous_blocks:
        a = lax.index_in_dim(v, 0, bit_axis, keepdims=True)
        b = lax.index_in_dim(v, 1, bit_axis, keepdims=True)
        return jnp.concatenate([a + b, a - b], axis=bit_axis)
    sign = np.ones((1,) * v.ndim, np.float32).repeat(2, bit_axis)
    sign[(slice(None),) * bit_axis + (1,)] = -1.0
    return v * sign + lax.rev(v, (bit_axis,))


def inverse_random_hadamard_transform(y: jax.Array, axis: int = -1) -> jax.Array:
    """Undo `random_hadamard_transform` (v -> v @ R^T), in float32 at full precision."""
    pre, blocks, post = _blocks(y, axis)
    yb = y.astype(jnp.float32).reshape(pre, blocks, RHT_SIZE, post)
    # Contract the in-block index k with R^T; result dims (p, b, q, j) -> j back before q.
    x = lax.dot_general(
        yb, hadamard_matrix(jnp.float32).T, (((2,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )
    return jnp.moveaxis(x, 3, 2).reshape(y.shape)
