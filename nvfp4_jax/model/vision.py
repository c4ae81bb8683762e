"""The vision tower of the VLM: a ViT encoder (patch embedding, bidirectional encoder layers) and
the projector that maps its image tokens to the decoder's width.

Shape letters as in `layers.py`, plus: S image side (pixels), C channels, P image tokens
(`(S / patch)^2`), Q pixels of one patch (`patch^2 * C`), E the encoder's width, N its MLP width.

The encoder reuses the decoder's layers: every projection is a `layers.Dense` through the
dot_general factory it is handed, its MLP is `layers.MLP` (SwiGLU). Only the attention core
differs: every image token sees every other one (no causal mask, no rotary embedding; a learned
position embedding instead). Parameters (kernels [in, out], fp32):

    vision/patch_embed/kernel                 [Q, E]   ("patch", "embed")
    vision/position_embedding                 [P, E]   ("image_tokens", "embed")
    vision/layers_{i}/attention/{query,key,value}/kernel  [E, E]  ("embed", "q_heads_x_dim")
    vision/layers_{i}/attention/out/kernel    [E, E]   ("q_heads_x_dim", "embed")
    vision/layers_{i}/mlp/{gate,up}/kernel    [E, N]   ("embed", "mlp"); down [N, E]
    vision/layers_{i}/{attention,mlp}_norm/scale, vision/final_norm/scale   [E]
    projector/hidden/kernel [E, D] ("embed", "mlp"), projector/out/kernel [D, D] ("mlp", "embed")
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.config import ModelConfig
from nvfp4_jax.model.layers import BLD, BLHK, MLP, Dense, DotGeneralFactory, RMSNorm, constrain


def patchify(images_BxSxSxC: jax.Array, patch: int) -> jax.Array:
    """Images -> `patches_BxPxQ`: non-overlapping patch x patch squares in row-major order, each
    flattened (rows, columns, channels)."""
    B, S, _, C = images_BxSxSxC.shape
    n = S // patch
    grid_BxNxPxNxPxC = images_BxSxSxC.reshape(B, n, patch, n, patch, C)
    return grid_BxNxPxNxPxC.transpose(0, 1, 3, 2, 4, 5).reshape(B, n * n, patch * patch * C)


def bidirectional_attention(q_BxPxHxK: jax.Array, k_BxPxHxK: jax.Array, v_BxPxHxK: jax.Array) -> jax.Array:
    """Softmax attention with no mask (every token sees every token); scores and softmax in fp32."""
    K = q_BxPxHxK.shape[-1]
    scores_BxHxPxP = jnp.einsum("bphk,bqhk->bhpq", q_BxPxHxK, k_BxPxHxK,
                                preferred_element_type=jnp.float32) / np.sqrt(K).astype(np.float32)
    probs_BxHxPxP = jax.nn.softmax(scores_BxHxPxP, axis=-1).astype(q_BxPxHxK.dtype)
    out_BxPxHxK = jnp.einsum("bhpq,bqhk->bphk", probs_BxHxPxP, v_BxPxHxK, preferred_element_type=jnp.float32)
    return out_BxPxHxK.astype(q_BxPxHxK.dtype)


class EncoderAttention(nn.Module):
    """Q/K/V projections, bidirectional attention, output projection (multi-head, no rotary)."""

    num_heads: int
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None

    @nn.compact
    def __call__(self, x_BxPxE: jax.Array) -> jax.Array:
        B, P, E = x_BxPxE.shape
        H = self.num_heads

        def dense(features, axes, name):
            return Dense(features, axes, self.dtype, self.dot_general_cls, name=name)

        q, k, v = (constrain(dense(E, ("embed", "q_heads_x_dim"), name)(x_BxPxE).reshape(B, P, H, E // H), BLHK)
                   for name in ("query", "key", "value"))
        ctx_BxPxHxK = constrain(bidirectional_attention(q, k, v), BLHK)
        return dense(E, ("q_heads_x_dim", "embed"), "out")(ctx_BxPxHxK.reshape(B, P, E))


class EncoderLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then h + mlp(norm(h))."""

    cfg: ModelConfig
    mlp_dot_general_cls: DotGeneralFactory = None
    attention_dot_general_cls: DotGeneralFactory = None

    @nn.compact
    def __call__(self, x_BxPxE: jax.Array) -> jax.Array:
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        eps = cfg.normalization_layer_epsilon
        h_BxPxE = x_BxPxE + EncoderAttention(cfg.vision_num_heads, dtype, self.attention_dot_general_cls,
                                             name="attention")(RMSNorm(eps, dtype, name="attention_norm")(x_BxPxE))
        h_BxPxE = constrain(h_BxPxE, BLD)
        out_BxPxE = h_BxPxE + MLP(cfg.vision_mlp_dim, dtype, self.mlp_dot_general_cls, name="mlp")(
            RMSNorm(eps, dtype, name="mlp_norm")(h_BxPxE))
        return constrain(out_BxPxE, BLD)


class VisionEncoder(nn.Module):
    """`images_BxSxSxC -> tokens_BxPxE`: patch embedding (BF16, as the decoder's embedding), a
    learned position embedding, `vision_num_layers` encoder layers, a final norm.

    `mlp_dot_general_cls` feeds the encoder MLPs' gate/up/down projections (the vision recipe),
    `attention_dot_general_cls` the attention projections (the decoder's attention policy)."""

    cfg: ModelConfig
    mlp_dot_general_cls: DotGeneralFactory = None
    attention_dot_general_cls: DotGeneralFactory = None

    @nn.compact
    def __call__(self, images_BxSxSxC: jax.Array) -> jax.Array:
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        patches_BxPxQ = patchify(images_BxSxSxC.astype(jnp.float32), cfg.patch_size)
        x_BxPxE = Dense(cfg.vision_emb_dim, ("patch", "embed"), dtype, name="patch_embed")(patches_BxPxQ)
        position_PxE = self.param("position_embedding", nn.with_logical_partitioning(
            nn.initializers.normal(stddev=0.02), ("image_tokens", "embed")),
            (cfg.num_patches, cfg.vision_emb_dim), jnp.float32)
        x_BxPxE = constrain((x_BxPxE.astype(jnp.float32) + position_PxE).astype(dtype), BLD)
        for i in range(cfg.vision_num_layers):
            x_BxPxE = EncoderLayer(cfg, self.mlp_dot_general_cls, self.attention_dot_general_cls,
                                   name=f"layers_{i}")(x_BxPxE)
        return RMSNorm(cfg.normalization_layer_epsilon, dtype, name="final_norm")(x_BxPxE)


class Projector(nn.Module):
    """`tokens_BxPxE -> tokens_BxPxD`: a two-layer GELU MLP into the decoder's width, its GEMMs
    through the vision recipe's dot (token-major `[B * P, .]`, as `layers.MLP` hands its dots)."""

    features: int
    dtype: Any = jnp.bfloat16
    dot_general_cls: DotGeneralFactory = None

    @nn.compact
    def __call__(self, x_BxPxE: jax.Array) -> jax.Array:
        B, P, E = x_BxPxE.shape
        D = self.features
        hidden_TxD = Dense(D, ("embed", "mlp"), self.dtype, self.dot_general_cls, name="hidden")(
            x_BxPxE.reshape(B * P, E))
        out_TxD = Dense(D, ("mlp", "embed"), self.dtype, self.dot_general_cls, name="out")(nn.gelu(hidden_TxD))
        return constrain(out_TxD.reshape(B, P, D), BLD)
