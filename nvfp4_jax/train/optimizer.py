"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from nvfp4_jax.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    warmup_steps = int(cfg.steps * cfg.warmup_steps_fraction)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup_steps,
        decay_steps=max(cfg.steps, warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.cosine_learning_rate_final_fraction,
    )


def _decay_mask(params):
    # Weight decay on matrices only; norms' scales are vectors.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(cfg),
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.adam_weight_decay,
        mask=_decay_mask,
    )
    if cfg.gradient_clipping_threshold > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.gradient_clipping_threshold), adamw)
    return adamw
