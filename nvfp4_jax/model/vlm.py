"""A vision-language model: the ViT encoder and projector (`vision.py`) in front of the Llama
decoder (`llama.py`), which reads `[image tokens; text tokens]` causally.

Parameter tree: `vision/...` and `projector/...` (see `vision.py`), `decoder/...` (exactly the
Llama's tree, see `llama.py`). The decoder's sequence is the P image tokens followed by the
text's L tokens (`max_target_length = P + L`); logits and the loss are the text positions'
only, so the loss mask (`loss_weights_BxL`: 1 on answer and caption tokens) is over the text.

Three dot_general factories, as `Llama` takes them: `mlp_dot_general_cls` for the decoder's MLP
(`quantization`), `vision_dot_general_cls` for the encoder's MLPs and the projector
(`vision_quantization`), `attention_dot_general_cls` for the attention projections of both
towers (`attention_quantization`; BF16 by default). The patch embedding, the decoder's
embedding and LM head, the attention cores and the norms never see them.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from nvfp4_jax.config import ModelConfig
from nvfp4_jax.model.layers import BLD, DotGeneralFactory, constrain
from nvfp4_jax.model.llama import Llama
from nvfp4_jax.model.vision import Projector, VisionEncoder


class VLM(nn.Module):
    """`(tokens_BxL, images_BxSxSxC) -> logits_BxLxV` of the text positions, or `loss(...)`."""

    cfg: ModelConfig
    mlp_dot_general_cls: DotGeneralFactory = None
    attention_dot_general_cls: DotGeneralFactory = None
    attention_kernel: str | None = None
    vision_dot_general_cls: DotGeneralFactory = None

    def setup(self):
        cfg = self.cfg
        self.vision = VisionEncoder(cfg, self.vision_dot_general_cls, self.attention_dot_general_cls)
        self.projector = Projector(cfg.base_emb_dim, jnp.dtype(cfg.dtype), self.vision_dot_general_cls)
        self.decoder = Llama(cfg, self.mlp_dot_general_cls, self.attention_dot_general_cls, self.attention_kernel)

    def image_tokens(self, images_BxSxSxC: jax.Array) -> jax.Array:
        """Images -> the decoder-width image tokens `[B, P, D]` (encoder, then projector)."""
        return self.projector(self.vision(images_BxSxSxC))

    def features(self, tokens_BxL: jax.Array, images_BxSxSxC: jax.Array | None,
                 segment_ids_BxL: jax.Array | None = None, positions_BxL: jax.Array | None = None) -> jax.Array:
        """The decoder's final-norm output at the text positions, `[B, L, D]`.

        Images None: zeros (what `init` traces with). The image tokens take segment id 1 (a
        text token with id 1 sees them; padding, id 0, does not) and positions 0..P-1; the text's
        positions follow from P."""
        cfg = self.cfg
        B, L = tokens_BxL.shape
        P = cfg.num_patches
        if images_BxSxSxC is None:
            images_BxSxSxC = jnp.zeros((B, cfg.image_size, cfg.image_size, cfg.image_channels), jnp.float32)
        x_BxTxD = constrain(jnp.concatenate(
            [self.image_tokens(images_BxSxSxC), self.decoder.embed(tokens_BxL)], axis=1), BLD)
        text_positions_BxL = jnp.broadcast_to(jnp.arange(L), (B, L)) if positions_BxL is None else positions_BxL
        positions_BxT = jnp.concatenate([jnp.broadcast_to(jnp.arange(P), (B, P)), P + text_positions_BxL], axis=1)
        segments_BxT = None
        if segment_ids_BxL is not None:
            segments_BxT = jnp.concatenate([jnp.ones((B, P), segment_ids_BxL.dtype), segment_ids_BxL], axis=1)
        return self.decoder.features(x_BxTxD, segments_BxT, positions_BxT)[:, P:]

    def __call__(self, tokens_BxL: jax.Array, images_BxSxSxC: jax.Array | None = None, *,
                 segment_ids_BxL: jax.Array | None = None, positions_BxL: jax.Array | None = None) -> jax.Array:
        return self.decoder.lm_head(self.features(tokens_BxL, images_BxSxSxC, segment_ids_BxL, positions_BxL))

    def loss(self, tokens_BxL: jax.Array, targets_BxL: jax.Array, *, images_BxSxSxC: jax.Array | None = None,
             segment_ids_BxL: jax.Array | None = None, positions_BxL: jax.Array | None = None,
             loss_weights_BxL: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """`Llama.loss` over the text positions, the image tokens ahead of them: the weighted
        mean next-token cross-entropy and the weight it divides by."""
        h_BxLxD = self.features(tokens_BxL, images_BxSxSxC, segment_ids_BxL, positions_BxL)
        return self.decoder.mean_loss(h_BxLxD, targets_BxL, loss_weights_BxL)
