"""Llama 3 building blocks: the projection, RMSNorm, rotary embedding, causal GQA attention, SwiGLU.

Shape letters: B batch, L sequence, D model width, F MLP width, V vocabulary, H query heads,
G key/value heads, R = H / G query heads per key/value head, K head dim, M key positions.

Every projection is a `Dense`, which calls the `dot_general` its factory gives it; nothing here
knows what that dot does. Parameters are fp32; `Dense` casts them to the compute dtype.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# A zero-argument factory returning a `jax.lax.dot_general`-compatible callable (a plain function
# or a Flax module instance); None means `jax.lax.dot_general`.
DotGeneralFactory = Optional[Callable[[], Callable[..., jax.Array]]]

# Logical axis names of every parameter; nvfp4_jax.sharding maps each to mesh axes.
PARAM_AXES = {
    "vocab": "vocabulary, V (embedding rows, LM head columns)",
    "embed": "model width, D",
    "mlp": "MLP hidden width, F",
    "q_heads_x_dim": "query heads x head dim, H*K (Q columns, O rows)",
    "kv_heads_x_dim": "key/value heads x head dim, G*K (K and V columns)",
    "norm": "RMSNorm scale, D",
}

# Logical axis names of activations; nvfp4_jax.sharding maps them (outside a mesh they are no-ops).
ACTIVATION_AXES = {
    "activation_batch": "batch, B",
    "activation_length": "sequence, L",
    "activation_embed": "model width of activations, D",
    "activation_mlp": "MLP hidden width of activations, F",
    "activation_heads": "attention heads of activations, H or G",
    "activation_kv": "head dim of activations, K",
    "activation_vocab": "logits' vocabulary axis, V",
}
BLD = ("activation_batch", "activation_length", "activation_embed")
BLF = ("activation_batch", "activation_length", "activation_mlp")
BLHK = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
BLV = ("activation_batch", "activation_length", "activation_vocab")


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """Pins an activation's sharding by logical axis names (FSDP keeps activations batch-split)."""
    return nn.with_logical_constraint(x, logical_axes)


_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


class Dense(nn.Module):
    """`x[..., K] @ kernel[K, N]` through the given dot_general; kernel fp32, math in `dtype`."""

    features: int
    kernel_axes: tuple[str, str]
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None
    # Only the LM head asks for fp32 output; it never gets a quantized dot.
    preferred_element_type: Any = None

    @nn.compact
    def __call__(self, x_BxLxK: jax.Array) -> jax.Array:
        kernel_KxN = self.param(
            "kernel",
            nn.with_logical_partitioning(_kernel_init, self.kernel_axes),
            (x_BxLxK.shape[-1], self.features),
            jnp.float32,
        )
        dot_general = self.dot_general_cls() if self.dot_general_cls else jax.lax.dot_general
        dims = (((x_BxLxK.ndim - 1,), (0,)), ((), ()))
        # Ask every dot for fp32 output (fp32 accumulation, rounded once to the output dtype);
        # on CPU a bf16-output dot is also about 2x slower.
        y_BxLxN = dot_general(
            x_BxLxK.astype(self.dtype), kernel_KxN.astype(self.dtype), dims,
            preferred_element_type=jnp.float32,
        )
        return y_BxLxN.astype(self.preferred_element_type or self.dtype)


class Embed(nn.Module):
    """Token embedding: an fp32 [V, D] table, looked up and returned in `dtype`."""

    vocab_size: int
    features: int
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        embedding_VxD = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0), ("vocab", "embed")),
            (self.vocab_size, self.features),
            jnp.float32,
        )
        # Gather the table whole (FSDP gathers weights) so the lookup runs on this device's rows
        # of the batch, rather than looking up embedding slices and moving activations.
        embedding_VxD = constrain(embedding_VxD, (None, None))
        return constrain(jnp.take(embedding_VxD, tokens_BxL, axis=0).astype(self.dtype), BLD)


class RMSNorm(nn.Module):
    """`x / rms(x) * scale`, computed in fp32, returned in `dtype`."""

    epsilon: float = 1e-5
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        scale_D = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (x_BxLxD.shape[-1],), jnp.float32,
        )
        x_BxLxD = x_BxLxD.astype(jnp.float32)
        mean_sq_BxLx1 = jnp.mean(jnp.square(x_BxLxD), axis=-1, keepdims=True)
        return (x_BxLxD * jax.lax.rsqrt(mean_sq_BxLx1 + self.epsilon) * scale_D).astype(self.dtype)


def rope_frequencies(
    head_dim: int,
    max_timescale: float,
    scaling_factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> np.ndarray:
    """Llama 3 rotary inverse frequencies, float64 [head_dim // 2].

    `theta ** (-2i / head_dim)`; with `scaling_factor > 1`, Llama 3.1's rescaling: wavelengths
    shorter than `original_max_position / high_freq_factor` are kept, those longer than
    `original_max_position / low_freq_factor` are divided by `scaling_factor`, and the band in
    between is interpolated smoothly.
    """
    inv_freq = 1.0 / max_timescale ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling_factor <= 1.0:
        return inv_freq
    wavelen = 2 * np.pi / inv_freq
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling_factor + smooth * inv_freq
    low = wavelen > original_max_position / low_freq_factor
    scaled = np.where(low, inv_freq / scaling_factor, interpolated)
    return np.where(wavelen < original_max_position / high_freq_factor, inv_freq, scaled)


def apply_rope(x_BxLxHxK: jax.Array, positions_L: jax.Array, inv_freq_K2: np.ndarray) -> jax.Array:
    """Rotates the pairs (x[i], x[i + K/2]) by angle position * inv_freq[i], in fp32.

    The half-split pairing of Hugging Face's Llama; Meta's checkpoints pair (x[2i], x[2i+1]), so
    their Q/K kernels would need HF's column permutation to load here.
    """
    angle_LxK2 = positions_L.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq_K2, jnp.float32)
    angle_Lx1xK2 = angle_LxK2[:, None, :]
    cos, sin = jnp.cos(angle_Lx1xK2), jnp.sin(angle_Lx1xK2)
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxLxHxK.dtype)


def causal_attention(q_BxLxHxK: jax.Array, k_BxMxGxK: jax.Array, v_BxMxGxK: jax.Array) -> jax.Array:
    """Grouped-query causal softmax attention; scores and softmax in fp32, output in q's dtype."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxMxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
    scores_BxGxRxLxM = jnp.einsum(
        "blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxMxGxK, preferred_element_type=jnp.float32
    ) / np.sqrt(K).astype(np.float32)
    causal_LxM = jnp.tril(jnp.ones((L, k_BxMxGxK.shape[1]), dtype=bool))
    # A finite minimum (not -inf) keeps fully masked rows NaN-free; exp() of it is exactly 0.
    scores_BxGxRxLxM = jnp.where(causal_LxM, scores_BxGxRxLxM, jnp.finfo(jnp.float32).min)
    probs_BxGxRxLxM = jax.nn.softmax(scores_BxGxRxLxM, axis=-1).astype(q_BxLxHxK.dtype)
    out_BxLxGxRxK = jnp.einsum(
        "bgrlm,bmgk->blgrk", probs_BxGxRxLxM, v_BxMxGxK, preferred_element_type=jnp.float32
    )
    return out_BxLxGxRxK.reshape(B, L, H, K).astype(q_BxLxHxK.dtype)


class Attention(nn.Module):
    """Q/K/V projections, rotary embedding, causal GQA, output projection."""

    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    inv_freq: tuple[float, ...]
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        B, L, D = x_BxLxD.shape
        H, G, K = self.num_query_heads, self.num_kv_heads, self.head_dim

        def dense(features, axes, name):
            return Dense(features, axes, self.dtype, self.dot_general_cls, name=name)

        q_BxLxHxK = dense(H * K, ("embed", "q_heads_x_dim"), "query")(x_BxLxD).reshape(B, L, H, K)
        k_BxLxGxK = dense(G * K, ("embed", "kv_heads_x_dim"), "key")(x_BxLxD).reshape(B, L, G, K)
        v_BxLxGxK = dense(G * K, ("embed", "kv_heads_x_dim"), "value")(x_BxLxD).reshape(B, L, G, K)
        positions_L = jnp.arange(L)
        inv_freq_K2 = np.asarray(self.inv_freq)
        q_BxLxHxK = constrain(apply_rope(q_BxLxHxK, positions_L, inv_freq_K2), BLHK)
        k_BxLxGxK = constrain(apply_rope(k_BxLxGxK, positions_L, inv_freq_K2), BLHK)
        v_BxLxGxK = constrain(v_BxLxGxK, BLHK)
        ctx_BxLxHxK = causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
        return dense(D, ("q_heads_x_dim", "embed"), "out")(ctx_BxLxHxK.reshape(B, L, H * K))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    mlp_dim: int
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        D = x_BxLxD.shape[-1]

        def dense(features, axes, name):
            return Dense(features, axes, self.dtype, self.dot_general_cls, name=name)

        gate_BxLxF = dense(self.mlp_dim, ("embed", "mlp"), "gate")(x_BxLxD)
        up_BxLxF = dense(self.mlp_dim, ("embed", "mlp"), "up")(x_BxLxD)
        hidden_BxLxF = constrain(nn.silu(gate_BxLxF) * up_BxLxF, BLF)
        return dense(D, ("mlp", "embed"), "down")(hidden_BxLxF)
