"""Data parallel training with per-process shares of a fixed global batch (issue 31, DDP): the numerics.

Every step has a fixed global batch of K microbatches of a fixed size M. Worker i trains its share
of k_i microbatches (sum k_i = K, k_i >= 1; every array keeps a static shape: no padding, no dummy
rows). The gradient must be the global batch's token-weighted mean, so each worker returns the SUM
of its per-token loss gradients and its token count (`share_sums`), the sums and counts are added
over workers and divided once (`combine`), and one optimizer update is applied. An equal-weight
mean of the workers' mean gradients is wrong as soon as the shares differ.

The shares are re-split by the controller the federated budgets use (`budget.allocate`, with the
quantum one microbatch and each worker's EMA-smoothed measured per-sample time): `split_shares`.

Not here yet: the multi-process driver on `jax.distributed` (see docs/scaling.md).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from nvfp4_jax.federated.budget import BudgetPolicy, SiteCost, allocate
from nvfp4_jax.train.step import document_inputs, make_eval_step


def token_count(batch) -> jax.Array:
    """The counted targets of `batch` (Llama.loss's total_weights)."""
    weights = document_inputs(batch).get("loss_weights_BxL")
    return jnp.asarray(batch["targets"].size if weights is None else weights.sum(), jnp.float32)


def share_sums(model, state, microbatches: Sequence[dict]):
    """(sum of per-token loss gradients, sum of per-token losses, token count) over one worker's
    microbatches, with the model's own loss (the eval step's, keyed as the train step's)."""
    eval_step = make_eval_step(model)
    key = state.sr_key()

    def summed_loss(params, batch):
        count = token_count(batch)
        # The mean loss times its denominator: the sum of the per-token losses.
        return eval_step(state.replace(params=params, rng=key), batch) * count, count

    grad_fn = jax.value_and_grad(summed_loss, has_aux=True)
    grads = loss_sum = count = None
    for batch in microbatches:
        (loss, n), g = grad_fn(state.params, batch)
        if grads is None:
            grads, loss_sum, count = g, loss, n
        else:
            grads = jax.tree.map(jnp.add, grads, g)
            loss_sum, count = loss_sum + loss, count + n
    return grads, loss_sum, count


def combine(parts: Sequence[tuple]):
    """The global batch's token-weighted mean gradient and mean loss from every worker's
    `share_sums`: sums and counts added over workers, divided once."""
    grads = jax.tree.map(lambda *gs: sum(gs[1:], gs[0]), *[p[0] for p in parts])
    loss_sum = sum(p[1] for p in parts[1:]) + parts[0][1]
    count = sum(p[2] for p in parts[1:]) + parts[0][2]
    return jax.tree.map(lambda g: g / count, grads), loss_sum / count


def split_shares(policy: BudgetPolicy, costs: Sequence[SiteCost], previous: Sequence[int] | None,
                 period_index: int) -> list[int]:
    """Microbatches per worker for the next period: `budget.allocate` over microbatches
    (`policy.quantum` = 1 microbatch, `total_samples` = K), at least one per worker."""
    if policy.quantum != 1:
        raise ValueError(f"quantum={policy.quantum}: a share is counted in microbatches, the quantum is 1")
    return allocate(policy, costs, previous, period_index)
