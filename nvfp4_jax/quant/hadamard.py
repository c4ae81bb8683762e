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


def hadamard_matrix(dtype=jnp.float32) -> jax.Array:
    """R = diag(signs) @ H16 / 4: orthogonal, entries +-0.25 (exact in bf16)."""
    return jnp.asarray(_R, dtype)


def _blockwise_matmul(x: jax.Array, r: jax.Array, axis: int, **dot_kwargs) -> jax.Array:
    """Multiply every 16-vector along `axis` by `r` on the right: v -> v @ r."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % RHT_SIZE:
        raise ValueError(
            f"random_hadamard_transform: axis {axis} has length {n}; it must be a multiple of "
            f"{RHT_SIZE}"
        )
    pre = int(np.prod(x.shape[:axis], dtype=np.int64))
    post = int(np.prod(x.shape[axis + 1 :], dtype=np.int64))
    xb = x.reshape(pre, n // RHT_SIZE, RHT_SIZE, post)
    # Contract the in-block index k; result dims (p, b, q, j) -> move j back before q.
    y = lax.dot_general(xb, r, (((2,), (0,)), ((), ())), **dot_kwargs)
    return jnp.moveaxis(y, 3, 2).reshape(x.shape)


def random_hadamard_transform(x: jax.Array, axis: int = -1) -> jax.Array:
    """Rotate each block of 16 along `axis` by R, as Blackwell's RHT does.

    Input cast to bf16, bf16 x bf16 products accumulated in fp32, result rounded to bf16.
    Returns bfloat16 of x's shape.
    """
    y = _blockwise_matmul(
        x.astype(jnp.bfloat16),
        hadamard_matrix(jnp.bfloat16),
        axis,
        preferred_element_type=jnp.float32,
    )
    return y.astype(jnp.bfloat16)


def inverse_random_hadamard_transform(y: jax.Array, axis: int = -1) -> jax.Array:
    """Undo `random_hadamard_transform` (v -> v @ R^T), in float32 at full precision."""
    return _blockwise_matmul(
        y.astype(jnp.float32),
        hadamard_matrix(jnp.float32).T,
        axis,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
