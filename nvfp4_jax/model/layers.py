"""Llama 3 building blocks: the projection, RMSNorm, rotary embedding, causal GQA attention, SwiGLU.

Shape letters: B batch, L sequence, D model width, F MLP width, V vocabulary, H query heads,
G key/value heads, R = H / G query heads per key/value head, K head dim, M key positions.

Every projection is a `Dense`, which calls the `dot_general` its factory gives it; nothing here
knows what that dot does. Parameters are fp32. `Dense` casts its kernel to the compute dtype for
`jax.lax.dot_general`, and hands a given dot_general the fp32 kernel, so that a quantized dot
quantizes from the master weights and returns their gradient in fp32.

Each projection's output carries a `checkpoint_name` (MaxText's names: `query_proj`, ...,
`mlpwo`, and `context` for the attention output) for the remat policies in `llama.py`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from nvfp4_jax.config import ModelConfig
from nvfp4_jax.model.attention import attention_fn
from nvfp4_jax.model.ulysses import context_parallel_attention

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
    "layers": "decoder layer of a scanned block, N (the leading axis nn.scan adds)",
    "lora_rank": "a LoRA adapter's rank, r (model/lora.py)",
    "patch": "pixels of one image patch, patch_size^2 x channels (model/vision.py)",
    "image_tokens": "image token position, (image_size / patch_size)^2 (model/vision.py)",
}

# Logical axis names of activations; nvfp4_jax.sharding maps them (outside a mesh they are no-ops).
BLD = ("activation_batch", "activation_length", "activation_embed")
BLF = ("activation_batch", "activation_length", "activation_mlp")
BLHK = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
BLV = ("activation_batch", "activation_length", "activation_vocab")


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """Pins an activation's sharding by logical axis names (FSDP keeps activations batch-split)."""
    return nn.with_logical_constraint(x, logical_axes)


kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def adapter_fields(adapter, projection: str) -> dict:
    """`Dense`'s LoRA fields for the projection named `projection` under `adapter` (None: none)."""
    rank = adapter.rank_for(projection) if adapter is not None else 0
    return {"lora_rank": rank, "lora_scale": adapter.scale if rank else 0.0}


class Dense(nn.Module):
    """`x[..., K] @ kernel[K, N]` through the given dot_general; kernel fp32, math in `dtype`."""

    features: int
    kernel_axes: tuple[str, str]
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None
    # Name of the output for remat policies (jax.ad_checkpoint.checkpoint_name); None: untagged.
    checkpoint_tag: Optional[str] = None
    # A LoRA adapter beside the kernel (model/lora.py): its rank (0: none) and alpha / rank.
    lora_rank: int = 0
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x_BxLxK: jax.Array) -> jax.Array:
        kernel_KxN = self.param(
            "kernel",
            nn.with_logical_partitioning(kernel_init, self.kernel_axes),
            (x_BxLxK.shape[-1], self.features),
            jnp.float32,
        )
        if self.dot_general_cls:
            # A given dot (quantized) takes the fp32 master kernel: it quantizes from full
            # precision and returns the kernel's gradient in fp32, as the recipe says.
            dot_general, kernel_KxN = self.dot_general_cls(), kernel_KxN
        else:
            dot_general, kernel_KxN = jax.lax.dot_general, kernel_KxN.astype(self.dtype)
        dims = (((x_BxLxK.ndim - 1,), (0,)), ((), ()))
        # Ask every dot for fp32 output (fp32 accumulation, rounded once to the output dtype);
        # on CPU a bf16-output dot is also about 2x slower.
        y_BxLxN = dot_general(x_BxLxK.astype(self.dtype), kernel_KxN, dims, preferred_element_type=jnp.float32)
        if self.lora_rank:
            y_BxLxN = y_BxLxN + self.lora_scale * self._low_rank(x_BxLxK, dims)
        y_BxLxN = y_BxLxN.astype(self.dtype)
        return checkpoint_name(y_BxLxN, self.checkpoint_tag) if self.checkpoint_tag else y_BxLxN


    def _low_rank(self, x_BxLxK: jax.Array, dims) -> jax.Array:
        """`(x A) B` in fp32: A [K, r] (the kernel's init), B [r, N] zeros, both fp32 masters
        multiplied in the compute dtype by plain dots, whatever dot the kernel goes through."""
        k_axis, n_axis = self.kernel_axes
        a_KxR = self.param("lora_a", nn.with_logical_partitioning(kernel_init, (k_axis, "lora_rank")),
                           (x_BxLxK.shape[-1], self.lora_rank), jnp.float32)
        b_RxN = self.param("lora_b", nn.with_logical_partitioning(nn.initializers.zeros, ("lora_rank", n_axis)),
                           (self.lora_rank, self.features), jnp.float32)
        xa_BxLxR = jax.lax.dot_general(x_BxLxK.astype(self.dtype), a_KxR.astype(self.dtype), dims,
                                       preferred_element_type=jnp.float32).astype(self.dtype)
        return jax.lax.dot_general(xa_BxLxR, b_RxN.astype(self.dtype), dims, preferred_element_type=jnp.float32)


class Embed(nn.Module):
    """Token embedding: an fp32 [V, D] table, looked up and returned in `dtype`.

    Under FSDP the table stays split along D as stored: every device of an FSDP group looks up
    the group's tokens in its own D-slice (the token ids are gathered, a few bytes each), and
    one all-to-all turns the `[B_group, L, D/fsdp]` result into this device's `[B/devices, L, D]`
    rows. No device ever holds the whole table, and the backward pass scatters into the slice.
    """

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
        table_VxD = constrain(embedding_VxD, ("vocab", "embed"))
        tokens_BxL = constrain(tokens_BxL, ("activation_lookup_batch", "activation_lookup_length"))
        # Look up in fp32 (the backward scatter-adds repeated tokens' gradients in fp32), then
        # cast before the all-to-all, which moves half the bytes.
        x_BxLxD = constrain(
            jnp.take(table_VxD, tokens_BxL, axis=0).astype(self.dtype),
            ("activation_lookup_batch", "activation_lookup_length", "activation_lookup_embed"),
        )
        return constrain(x_BxLxD, BLD)


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


def apply_rope(x_BxLxHxK: jax.Array, positions_BxL: jax.Array, inv_freq_K2: np.ndarray) -> jax.Array:
    """Rotates the pairs (x[i], x[i + K/2]) by angle position * inv_freq[i], in fp32.

    `positions_BxL` is each token's position in its document ([B, L], or [L] for every row).

    The half-split pairing of Hugging Face's Llama; Meta's checkpoints pair (x[2i], x[2i+1]), so
    their Q/K kernels would need HF's column permutation to load here.
    """
    angle_BxLxK2 = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_K2, jnp.float32)
    angle_BxLx1xK2 = angle_BxLxK2[..., None, :]
    cos, sin = jnp.cos(angle_BxLx1xK2), jnp.sin(angle_BxLx1xK2)
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxLxHxK.dtype)


class Attention(nn.Module):
    """Q/K/V projections, rotary embedding, causal GQA within segments, output projection.

    `segment_ids_BxL` (None: one segment per row) keeps attention inside each document;
    `positions_BxL` (None: 0..L-1) are the rotary positions, restarting per document.
    """

    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    inv_freq: tuple[float, ...]
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None
    # One of attention.KERNELS (already resolved: never "autoselected" here).
    kernel: str = "dot_product"
    # How the kernel runs on a sequence split over devices (model.ulysses.STRATEGIES).
    context_strategy: str = "all_gather"
    # Queries and keys per block of the chunked kernel (attention_chunk_size).
    chunk_size: int = ModelConfig.attention_chunk_size
    # LoRA adapters beside the projections it targets (model/lora.Adapter; None: none).
    adapter: Any = None

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None,
                 positions_BxL: jax.Array | None = None) -> jax.Array:
        B, L, D = x_BxLxD.shape
        H, G, K = self.num_query_heads, self.num_kv_heads, self.head_dim

        def dense(features, axes, name):
            return Dense(features, axes, self.dtype, self.dot_general_cls, name=name,
                         checkpoint_tag=f"{name}_proj", **adapter_fields(self.adapter, name))

        q_BxLxHxK = dense(H * K, ("embed", "q_heads_x_dim"), "query")(x_BxLxD).reshape(B, L, H, K)
        k_BxLxGxK = dense(G * K, ("embed", "kv_heads_x_dim"), "key")(x_BxLxD).reshape(B, L, G, K)
        v_BxLxGxK = dense(G * K, ("embed", "kv_heads_x_dim"), "value")(x_BxLxD).reshape(B, L, G, K)
        positions_BxL = jnp.arange(L)[None] if positions_BxL is None else positions_BxL
        inv_freq_K2 = np.asarray(self.inv_freq)
        q_BxLxHxK = constrain(apply_rope(q_BxLxHxK, positions_BxL, inv_freq_K2), BLHK)
        k_BxLxGxK = constrain(apply_rope(k_BxLxGxK, positions_BxL, inv_freq_K2), BLHK)
        v_BxLxGxK = constrain(v_BxLxGxK, BLHK)
        attend = context_parallel_attention(attention_fn(self.kernel, self.chunk_size), self.context_strategy)
        ctx_BxLxHxK = attend(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL=segment_ids_BxL)
        ctx_BxLxHxK = checkpoint_name(constrain(ctx_BxLxHxK, BLHK), "context")
        return dense(D, ("q_heads_x_dim", "embed"), "out")(ctx_BxLxHxK.reshape(B, L, H * K))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    mlp_dim: int
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None
    adapter: Any = None  # as Attention's

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        D = x_BxLxD.shape[-1]

        def dense(features, axes, name, tag):
            return Dense(features, axes, self.dtype, self.dot_general_cls, name=name, checkpoint_tag=tag,
                         **adapter_fields(self.adapter, name))

        if not self.dot_general_cls:
            gate_BxLxF = dense(self.mlp_dim, ("embed", "mlp"), "gate", "mlpwi_0")(x_BxLxD)
            up_BxLxF = dense(self.mlp_dim, ("embed", "mlp"), "up", "mlpwi_1")(x_BxLxD)
            hidden_BxLxF = constrain(nn.silu(gate_BxLxF) * up_BxLxF, BLF)
            return dense(D, ("mlp", "embed"), "down", "mlpwo")(hidden_BxLxF)
        # A given (quantized) dot multiplies tokens x features: it would flatten B and L
        # itself. Flattened once here, the SwiGLU's elementwise work has the GEMMs' own shape;
        # with a reshape on each side of it, XLA's simplifier (algsimp against reshape-mover)
        # moves the reshapes back and forth until its iteration cap, 25 passes over the whole
        # step instead of 7. Same values; `lax.dot_general` (BF16) keeps [B, L, D].
        B, L = x_BxLxD.shape[:2]
        x_TxD = x_BxLxD.reshape(B * L, D)
        gate_TxF = dense(self.mlp_dim, ("embed", "mlp"), "gate", "mlpwi_0")(x_TxD)
        up_TxF = dense(self.mlp_dim, ("embed", "mlp"), "up", "mlpwi_1")(x_TxD)
        hidden_BxLxF = constrain((nn.silu(gate_TxF) * up_TxF).reshape(B, L, self.mlp_dim), BLF)
        out_TxD = dense(D, ("mlp", "embed"), "down", "mlpwo")(hidden_BxLxF.reshape(B * L, self.mlp_dim))
        return out_TxD.reshape(B, L, D)
