"""Pure train and eval steps: `train_step(state, batch) -> (state, metrics)`."""

from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from nvfp4_jax.model import lora
from nvfp4_jax.quant import health, quant_rngs
from nvfp4_jax.train.integrity import finite_flags
from nvfp4_jax.train.state import TrainState


def _variables(params, fp8_meta):
    # fp8_meta maps each overwrite-with-gradient collection (ours, TE's) to its variables.
    return {"params": params, **fp8_meta}


# MaxText's packed-batch keys: all three or none (see `document_inputs`).
DOCUMENT_KEYS = ("inputs_segmentation", "inputs_position", "targets_segmentation")


def document_inputs(batch) -> dict:
    """`Llama.loss`'s keyword arguments for a batch's documents: segment ids, positions and the
    loss weights (1 where `targets_segmentation` is nonzero); {} for a batch without them (one
    document per row, every target counted)."""
    present = [k for k in DOCUMENT_KEYS if k in batch]
    if not present:
        return {}
    if len(present) != len(DOCUMENT_KEYS):
        missing = [k for k in DOCUMENT_KEYS if k not in batch]
        raise ValueError(f"a batch with {present} must also hold {missing} (all of {list(DOCUMENT_KEYS)} or none)")
    return {
        "segment_ids_BxL": batch["inputs_segmentation"],
        "positions_BxL": batch["inputs_position"],
        "loss_weights_BxL": (batch["targets_segmentation"] != 0).astype(jnp.float32),
    }


def image_inputs(batch) -> dict:
    """The VLM's keyword argument for a batch's images (`images`, float32 `[B, S, S, C]`); {}
    for a text batch."""
    return {"images_BxSxSxC": batch["images"]} if "images" in batch else {}


def _loss(model: nn.Module, params, fp8_meta, batch, key) -> tuple[jax.Array, jax.Array]:
    """Next-token loss in fp32 over the counted targets, and their number (MaxText's total_weights).

    The model computes it (`Llama.loss`), so that the LM head can run inside the loss's tiles.
    Under jit the batch is the global batch, so both sums (losses and counted tokens) run over
    every device's rows: a shard with padding or masked targets gets the right gradient.
    """
    return model.apply(
        _variables(params, fp8_meta), batch["inputs"], batch["targets"], method="loss",
        rngs=quant_rngs(key), **document_inputs(batch), **image_inputs(batch),
    )


def make_train_step(
    model: nn.Module, optimizer: optax.GradientTransformation, *, uses_fp8_meta: bool = True,
    adapters_only: bool = False,
) -> Callable:
    """Returns the pure step. Jit it with donated state (see loop.py).

    `uses_fp8_meta=False` is for a model built without quantized dots (the BF16 tail of a run):
    its FP8 histories pass through untouched instead of being overwritten by zero cotangents.
    `adapters_only=True` (a frozen backbone, `optimizer` from `lora.freeze_backbone`)
    differentiates the LoRA adapters alone: the backbone's kernels get no weight gradient and
    stay bit for bit; `grad_norm` is the adapters'.
    """

    def gradients(state: TrainState, batch):
        if not adapters_only:
            return jax.value_and_grad(functools.partial(_loss, model), argnums=(0, 1), has_aux=True)(
                state.params, state.fp8_meta, batch, state.sr_key())
        backbone, adapters = lora.split(state.params)
        (loss, total_weights), (adapter_grads, fp8_grads) = jax.value_and_grad(
            lambda a, meta: _loss(model, lora.join(backbone, a), meta, batch, state.sr_key()),
            argnums=(0, 1), has_aux=True)(adapters, state.fp8_meta)
        return (loss, total_weights), (adapter_grads, fp8_grads)

    def apply(state: TrainState, grads):
        if not adapters_only:
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), opt_state
        backbone, adapters = lora.split(state.params)
        # The backbone's zero gradients are never read (`freeze_backbone`), so never computed.
        full = lora.join(jax.tree.map(jnp.zeros_like, backbone), grads)
        updates, opt_state = optimizer.update(full, state.opt_state, state.params)
        return lora.join(backbone, optax.apply_updates(adapters, lora.split(updates)[1])), opt_state

    def train_step(state: TrainState, batch) -> tuple[TrainState, dict]:
        (loss, total_weights), (grads, fp8_grads) = gradients(state, batch)
        params, opt_state = apply(state, grads)
        # Overwrite-with-gradient: the quantized dot's VJP returns the new amax history as the
        # cotangent of the old one.
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            fp8_meta=fp8_grads if uses_fp8_meta else state.fp8_meta,
        )
        metrics = {
            "loss": loss,
            "total_weights": total_weights,
            "grad_norm": optax.tree.norm(grads),
            # Per leaf of the new state (integrity.leaf_paths order): a checkpoint is saved only
            # when all are finite.
            "finite": finite_flags(new_state),
        }
        return new_state, metrics

    return train_step


def make_eval_step(model: nn.Module) -> Callable:
    def eval_step(state: TrainState, batch) -> jax.Array:
        # The forward pass never rounds stochastically, but a quantized dot may still ask its
        # rng stream for a key: any fixed one will do.
        return _loss(model, state.params, state.fp8_meta, batch, state.rng)[0]

    return eval_step


def make_quant_stats_step(model: nn.Module, template) -> Callable:
    """`stats_step(state, batch) -> stats`: what quantization does to every quantized operand in
    one forward and backward pass on `batch`, changing nothing.

    `model` is built with `quant_stats=True` (its dots keep zero statistics in the collection
    `health.COLLECTION`) and `template` is that collection's abstract value. The statistics are
    the gradient with respect to those zeros (the dots return them as cotangents), so this is
    the one place they are computed: the train step's model never holds the collection.
    """

    def stats_step(state: TrainState, batch):
        def loss_fn(stats):
            # The statistics ride beside the overwrite-with-gradient collections.
            collections = {**state.fp8_meta, health.COLLECTION: stats}
            return _loss(model, state.params, collections, batch, state.sr_key())[0]

        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), template)
        return jax.grad(loss_fn)(zeros)

    return stats_step
