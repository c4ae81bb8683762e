"""Llama 3 decoder with one quantization seam: the dot_general each projection is given.

Parameter tree (`N` decoder layers, kernels are [in, out], all fp32). With `scan_layers=True`
the decoder layers are one `nn.scan` named `layers` whose parameters carry a leading layer axis
(logical name "layers"); with `scan_layers=False` each layer is its own `layers_{i}`:

    token_embedder/embedding            [V, D]       ("vocab", "embed")
    layers/attention_norm/scale         [N, D]       ("layers", "norm")
    layers/attention/query/kernel       [N, D, H*K]  ("layers", "embed", "q_heads_x_dim")
    layers/attention/key/kernel         [N, D, G*K]  ("layers", "embed", "kv_heads_x_dim")
    layers/attention/value/kernel       [N, D, G*K]  ("layers", "embed", "kv_heads_x_dim")
    layers/attention/out/kernel         [N, H*K, D]  ("layers", "q_heads_x_dim", "embed")
    layers/mlp_norm/scale               [N, D]       ("layers", "norm")
    layers/mlp/{gate,up}/kernel         [N, D, F]    ("layers", "embed", "mlp")
    layers/mlp/down/kernel              [N, F, D]    ("layers", "mlp", "embed")
    final_norm/scale                    [D]          ("norm",)
    lm_head/kernel                      [D, V]       ("embed", "vocab")

Scanned, the BF16 layers at either end (`bf16_first_layers`, `bf16_last_layers`) stay unrolled
as `layers_{i}` around the scanned quantized block, whose leading axis then counts only its own
layers. A dot_general factory that returns a Flax module adds it under its projection, e.g.
`layers/mlp/gate/QuantDotGeneral_0`, with that module's own variables (stacked like the
parameters when scanned) and rng path.

Random numbers are independent of the layout: every rng stream a decoder layer sees (parameter
init, the quantizer's stochastic rounding) is its parent's key folded with the layer's index,
not with the layer's name. Layer i therefore draws the same keys scanned or unrolled (init
gives the same numbers, stacked or not), different keys from every other layer, and, because
the train step passes a new key per step, new keys every step.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import lift
from flax.core.scope import LazyRng

from nvfp4_jax.config import ModelConfig
from nvfp4_jax.model import lora
from nvfp4_jax.model.attention import select_attention
from nvfp4_jax.model.layers import (
    BLD, MLP, Attention, DotGeneralFactory, Embed, RMSNorm, constrain, rope_frequencies,
)
from nvfp4_jax.model.loss import LMHead

# Remat policies by MaxText's names: which tagged activations (`checkpoint_name` in layers.py)
# a decoder layer keeps for its backward pass; everything else is recomputed from its input.
# "full" keeps none of them; "none" (no remat) keeps everything.
ATTENTION_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj")
MLP_PROJECTIONS = ("mlpwi_0", "mlpwi_1", "mlpwo")
REMAT_SAVED_NAMES: dict[str, tuple[str, ...]] = {
    "full": (),
    "minimal": ATTENTION_PROJECTIONS + MLP_PROJECTIONS,
    "minimal_with_context": ATTENTION_PROJECTIONS + ("context",) + MLP_PROJECTIONS,
    "save_dot_except_mlp": ATTENTION_PROJECTIONS,
}


def remat_policy(name: str):
    """The `jax.checkpoint` policy of a remat_policy name (None for "full": save nothing)."""
    if name not in REMAT_SAVED_NAMES:
        raise ValueError(f"remat_policy={name!r} has no jax.checkpoint policy; choose one of "
                         f"{sorted(REMAT_SAVED_NAMES)} (or 'none' for no remat)")
    saved = REMAT_SAVED_NAMES[name]
    return jax.checkpoint_policies.save_only_these_names(*saved) if saved else None


def layer_is_quantized(cfg: ModelConfig, layer: int) -> bool:
    """False for the `bf16_first_layers` first and `bf16_last_layers` last decoder layers."""
    return cfg.bf16_first_layers <= layer < cfg.base_num_decoder_layers - cfg.bf16_last_layers


class LayerBlock(NamedTuple):
    """Decoder layers `start .. stop-1`, run as one scan (`scanned`) or as one unrolled layer."""

    start: int
    stop: int
    scanned: bool

    @property
    def name(self) -> str:
        return "layers" if self.scanned else f"layers_{self.start}"


def layer_blocks(cfg: ModelConfig) -> list[LayerBlock]:
    """The decoder's layout: scanned, the quantized middle is one scan and the BF16 ends unrolled."""
    n = cfg.base_num_decoder_layers
    if not cfg.scan_layers:
        return [LayerBlock(i, i + 1, False) for i in range(n)]
    first, stop = cfg.bf16_first_layers, n - cfg.bf16_last_layers
    middle = [LayerBlock(first, stop, True)] if stop > first else []
    return ([LayerBlock(i, i + 1, False) for i in range(first)] + middle
            + [LayerBlock(i, i + 1, False) for i in range(stop, n)])


def _per_layer_rngs(fn):
    """Lifted transform: `fn(scope, x, layer_index, *rest)` with every rng stream re-rooted per layer.

    Each stream's key becomes `fold_in(parent's key, layer_index)` (the parent being the module
    that holds the layer), and the layer's draw counters start afresh on every call, so the keys
    a layer draws depend on its index and its own submodule paths only: the same whether it is
    `layers_{i}` or iteration i of a scan, however often the scan body is traced.
    """

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, x, layer_index, *rest):
        def reroot(rng):
            # rng is the layer scope's lazy key: the stream's root plus the path to this
            # layer; the path's last entry is the layer's own name, which the index replaces.
            parent = LazyRng(rng.rng, rng.suffix[:-1]).as_jax_rng()
            return LazyRng.create(jax.random.fold_in(parent, layer_index))

        rng_groups = jax.tree.map(reroot, rng_groups, is_leaf=lambda r: isinstance(r, LazyRng))
        scopes = scope_fn(variable_groups, rng_groups)
        for scope in jax.tree_util.tree_leaves(scopes):
            scope.rng_counters = {stream: 0 for stream in scope.rngs}
        return fn(scopes, x, layer_index, *rest), repack_fn(scopes)

    return lift.pack(inner, (True,), (True,), (True,), name="per_layer_rngs")


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then h + mlp(norm(h)).

    Called as `layer(x, layer_index, segment_ids_BxL, positions_BxL) -> (x, None)`, the form
    `nn.scan` needs (the last two broadcast to every layer); `layer_index` is data (a traced
    int32), used only through the per-layer rngs.
    """

    cfg: ModelConfig
    mlp_dot_general_cls: DotGeneralFactory = None
    attention_dot_general_cls: DotGeneralFactory = None
    attention_kernel: str = "dot_product"

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, layer_index: jax.Array,
                 segment_ids_BxL: jax.Array | None = None, positions_BxL: jax.Array | None = None):
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        inv_freq = rope_frequencies(
            cfg.head_dim, cfg.rope_max_timescale, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor, cfg.rope_original_max_position,
        )
        eps = cfg.normalization_layer_epsilon
        adapter = lora.from_config(cfg)
        h_BxLxD = x_BxLxD + Attention(
            cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim, tuple(inv_freq.tolist()),
            dtype, self.attention_dot_general_cls, self.attention_kernel, chunk_size=cfg.attention_chunk_size,
            context_strategy=cfg.context_parallel_strategy, adapter=adapter, name="attention",
        )(RMSNorm(eps, dtype, name="attention_norm")(x_BxLxD), segment_ids_BxL, positions_BxL)
        h_BxLxD = constrain(h_BxLxD, BLD)
        out_BxLxD = h_BxLxD + MLP(cfg.base_mlp_dim, dtype, self.mlp_dot_general_cls, adapter, name="mlp")(
            RMSNorm(eps, dtype, name="mlp_norm")(h_BxLxD)
        )
        return constrain(out_BxLxD, BLD), None


def _block_class(cfg: ModelConfig, block: LayerBlock):
    """DecoderLayer with per-layer rngs, remat as configured, and scan for a scanned block."""
    cls = nn.transforms.lift_transform(_per_layer_rngs, DecoderLayer)
    if cfg.remat_policy != "none":
        # Inside a scan, XLA cannot hoist the recomputation out of the loop: no CSE guard needed.
        cls = nn.remat(cls, policy=remat_policy(cfg.remat_policy), prevent_cse=not block.scanned)
    if block.scanned:
        cls = nn.scan(
            cls,
            variable_axes={True: 0},  # every collection: params, quantizer state, ...
            split_rngs={True: False},  # _per_layer_rngs makes each layer's keys its own
            in_axes=(0, nn.broadcast, nn.broadcast),  # layer index; segments, positions
            length=block.stop - block.start,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
    return cls


class Llama(nn.Module):
    """Llama 3 decoder: `tokens_BxL -> logits_BxLxV` (fp32), or `loss(tokens, targets)`.

    `mlp_dot_general_cls` feeds the MLP's gate/up/down projections and
    `attention_dot_general_cls` the attention's query/key/value/out projections, except in the
    BF16 layers (`layer_is_quantized` False), which use `jax.lax.dot_general` throughout. Each is
    a zero-argument factory returning a `jax.lax.dot_general`-compatible callable, called once
    per projection; None means `jax.lax.dot_general`. A given dot receives the activations in
    the compute dtype (`[B, L, K]`; in the MLP `[B * L, K]`, see `layers.MLP`) and the fp32
    kernel. The embedding, the LM head, attention's
    score/context products and the norms never see them.

    `attention_kernel` overrides the kernel `cfg.attention` selects (build_model passes the
    selection it made before tracing).
    """

    cfg: ModelConfig
    mlp_dot_general_cls: DotGeneralFactory = None
    attention_dot_general_cls: DotGeneralFactory = None
    attention_kernel: str | None = None

    def setup(self):
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        kernel = self.attention_kernel or select_attention(cfg.attention, seq_len=cfg.max_target_length).kernel
        self.token_embedder = Embed(cfg.vocab_size, cfg.base_emb_dim, dtype)
        for block in layer_blocks(cfg):
            dots = ((self.mlp_dot_general_cls, self.attention_dot_general_cls)
                    if layer_is_quantized(cfg, block.start) else (None, None))
            setattr(self, block.name, _block_class(cfg, block)(cfg, *dots, kernel))
        self.final_norm = RMSNorm(cfg.normalization_layer_epsilon, dtype)
        self.lm_head = LMHead(cfg.vocab_size, dtype)

    def embed(self, tokens_BxL: jax.Array) -> jax.Array:
        return self.token_embedder(tokens_BxL)

    def features(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None,
                 positions_BxL: jax.Array | None = None) -> jax.Array:
        """Embeddings -> the final norm's output, the LM head's input.

        `segment_ids_BxL` (document id per token; None: one per row) keeps attention inside
        each document; `positions_BxL` (None: 0..L-1) are the rotary positions.
        """
        for block in layer_blocks(self.cfg):
            index = jnp.arange(block.start, block.stop, dtype=jnp.int32)
            x_BxLxD, _ = getattr(self, block.name)(
                x_BxLxD, index if block.scanned else index[0], segment_ids_BxL, positions_BxL)
        return self.final_norm(x_BxLxD)

    def decode(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None,
               positions_BxL: jax.Array | None = None) -> jax.Array:
        """Embeddings -> fp32 logits (the model after the lookup; the causality test's entry)."""
        return self.lm_head(self.features(x_BxLxD, segment_ids_BxL, positions_BxL))

    def __call__(self, tokens_BxL: jax.Array, *, segment_ids_BxL: jax.Array | None = None,
                 positions_BxL: jax.Array | None = None) -> jax.Array:
        return self.decode(self.embed(tokens_BxL), segment_ids_BxL, positions_BxL)

    def loss(self, tokens_BxL: jax.Array, targets_BxL: jax.Array, *,
             segment_ids_BxL: jax.Array | None = None, positions_BxL: jax.Array | None = None,
             loss_weights_BxL: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Weighted mean next-token cross-entropy (fp32) and the weight it divides by.

        `sum(weight * loss) / sum(weight)` over the whole (global) batch: MaxText's
        `total_weights` is that denominator. `loss_weights_BxL` is the loss mask (1: counted,
        0: padding or masked; None counts every target); an all-zero mask gives loss 0. The
        logits are computed `num_vocab_tiling` tiles at a time (see `model/loss.py`).
        """
        h_BxLxD = self.features(self.embed(tokens_BxL), segment_ids_BxL, positions_BxL)
        return self.mean_loss(h_BxLxD, targets_BxL, loss_weights_BxL)

    def mean_loss(self, h_BxLxD: jax.Array, targets_BxL: jax.Array,
                  loss_weights_BxL: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """`loss` from the final norm's output `h_BxLxD` (the VLM's text positions enter here)."""
        total = self.lm_head(h_BxLxD, targets_BxL, self.cfg.num_vocab_tiling, loss_weights_BxL)
        if loss_weights_BxL is None:
            total_weights = jnp.asarray(targets_BxL.size, jnp.float32)
        else:
            total_weights = loss_weights_BxL.astype(jnp.float32).sum()
        # The weights count tokens (0 or 1): max(., 1) changes no count >= 1 and keeps an
        # all-padding batch's loss 0 instead of 0 / 0.
        return total / jnp.maximum(total_weights, 1.0), total_weights
