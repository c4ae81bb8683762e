"""Llama 3 decoder with one quantization seam: the dot_general each projection is given.

Parameter tree (`L` decoder layers, kernels are [in, out], all fp32):

    token_embedder/embedding            [V, D]    ("vocab", "embed")
    layers_{i}/attention_norm/scale     [D]       ("norm",)
    layers_{i}/attention/query/kernel   [D, H*K]  ("embed", "q_heads_x_dim")
    layers_{i}/attention/key/kernel     [D, G*K]  ("embed", "kv_heads_x_dim")
    layers_{i}/attention/value/kernel   [D, G*K]  ("embed", "kv_heads_x_dim")
    layers_{i}/attention/out/kernel     [H*K, D]  ("q_heads_x_dim", "embed")
    layers_{i}/mlp_norm/scale           [D]       ("norm",)
    layers_{i}/mlp/{gate,up}/kernel     [D, F]    ("embed", "mlp")
    layers_{i}/mlp/down/kernel          [F, D]    ("mlp", "embed")
    final_norm/scale                    [D]       ("norm",)
    lm_head/kernel                      [D, V]    ("embed", "vocab")

A dot_general factory that returns a Flax module adds it under its projection, e.g.
`layers_1/mlp/gate/QuantDotGeneral_0`, with that module's own variables and rng path.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from nvfp4_jax.config import ModelConfig
from nvfp4_jax.model.layers import (
    BLD, BLV, MLP, Attention, Dense, DotGeneralFactory, Embed, RMSNorm, constrain, rope_frequencies,
)


def layer_is_quantized(cfg: ModelConfig, layer: int) -> bool:
    """False for the `bf16_first_layers` first and `bf16_last_layers` last decoder layers."""
    return cfg.bf16_first_layers <= layer < cfg.base_num_decoder_layers - cfg.bf16_last_layers


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then h + mlp(norm(h))."""

    cfg: ModelConfig
    mlp_dot_general_cls: DotGeneralFactory = None
    attention_dot_general_cls: DotGeneralFactory = None

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        inv_freq = rope_frequencies(
            cfg.head_dim, cfg.rope_max_timescale, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor, cfg.rope_original_max_position,
        )
        eps = cfg.normalization_layer_epsilon
        h_BxLxD = x_BxLxD + Attention(
            cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim, tuple(inv_freq.tolist()),
            dtype, self.attention_dot_general_cls, name="attention",
        )(RMSNorm(eps, dtype, name="attention_norm")(x_BxLxD))
        h_BxLxD = constrain(h_BxLxD, BLD)
        out_BxLxD = h_BxLxD + MLP(cfg.base_mlp_dim, dtype, self.mlp_dot_general_cls, name="mlp")(
            RMSNorm(eps, dtype, name="mlp_norm")(h_BxLxD)
        )
        return constrain(out_BxLxD, BLD)


class Llama(nn.Module):
    """Llama 3 decoder: `tokens_BxL -> logits_BxLxV` (fp32).

    `mlp_dot_general_cls` feeds the MLP's gate/up/down projections and
    `attention_dot_general_cls` the attention's query/key/value/out projections, except in the
    BF16 layers (`layer_is_quantized` False), which use `jax.lax.dot_general` throughout. Each is
    a zero-argument factory returning a `jax.lax.dot_general`-compatible callable, called once
    per projection; None means `jax.lax.dot_general`. The embedding, the LM head, attention's
    score/context products and the norms never see them.
    """

    cfg: ModelConfig
    mlp_dot_general_cls: DotGeneralFactory = None
    attention_dot_general_cls: DotGeneralFactory = None

    def setup(self):
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        self.token_embedder = Embed(cfg.vocab_size, cfg.base_emb_dim, dtype)
        self.layers = [
            DecoderLayer(cfg, self.mlp_dot_general_cls, self.attention_dot_general_cls)
            if layer_is_quantized(cfg, i)
            else DecoderLayer(cfg)
            for i in range(cfg.base_num_decoder_layers)
        ]
        self.final_norm = RMSNorm(cfg.normalization_layer_epsilon, dtype)
        self.lm_head = Dense(
            cfg.vocab_size, ("embed", "vocab"), dtype, preferred_element_type=jnp.float32
        )

    def embed(self, tokens_BxL: jax.Array) -> jax.Array:
        return self.token_embedder(tokens_BxL)

    def decode(self, x_BxLxD: jax.Array) -> jax.Array:
        """Embeddings -> fp32 logits (the model after the lookup; the causality test's entry)."""
        for layer in self.layers:
            x_BxLxD = layer(x_BxLxD)
        return constrain(self.lm_head(self.final_norm(x_BxLxD)).astype(jnp.float32), BLV)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        return self.decode(self.embed(tokens_BxL))
