"""Data parallel training with per-process shares of a fixed global batch: the numerics.

Every step has a fixed global batch of K microbatches of a fixed size M. Worker i trains its share
of k_i microbatches (sum k_i = K, k_i >= 1; every array keeps a static shape: no padding, no dummy
rows). The gradient must be the global batch's token-weighted mean, so each worker returns the SUM
of its per-token loss gradients and its token count (`share_sums`), the sums and counts are added
over workers and divided once (`combine`), and one optimizer update is applied. An equal-weight
mean of the workers' mean gradients is wrong as soon as the shares differ.

The shares are re-split by the controller the federated budgets use (`budget.allocate`, with the
quantum one microbatch and each worker's EMA-smoothed measured per-sample time): `split_shares`.

Quantized runs: every microbatch has its own stochastic-rounding key, a function of the step and
its position in the global batch (`microbatch_key`), so any split computes each microbatch's
gradient bit for bit as any other split does, and the rounding noise differs between
microbatches. Delayed-scaling FP8 is refused (`ddp.check`): its amax histories are state the
train step updates, which a shares step does not carry or combine across workers.

`train_shares` is the multi-process driver (one process per worker on `jax.distributed`; `gather_combine`
adds the sums over processes); see docs/scaling.md for what is not done.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.flatten_util import ravel_pytree

from nvfp4_jax.federated.budget import BudgetPolicy, SiteCost, allocate, smooth
from nvfp4_jax.train.step import document_inputs, make_eval_step


def token_count(batch) -> jax.Array:
    """The counted targets of `batch` (Llama.loss's total_weights)."""
    weights = document_inputs(batch).get("loss_weights_BxL")
    return jnp.asarray(batch["targets"].size if weights is None else weights.sum(), jnp.float32)


def share_grad_fn(model):
    """One microbatch's ((sum of per-token losses, token count), gradient of that sum), jitted:
    built once per run, so that a step runs compiled code (one compilation per microbatch shape)."""
    eval_step = make_eval_step(model)

    def summed_loss(params, state, batch):
        count = token_count(batch)
        # The mean loss times its denominator: the sum of the per-token losses.
        return eval_step(state.replace(params=params), batch) * count, count

    return jax.jit(jax.value_and_grad(summed_loss, has_aux=True))


def microbatch_key(state, index: int) -> jax.Array:
    """The stochastic-rounding key of the step's microbatch `index` (its position in the global
    batch): the step's key folded with the index. Its random bits are a function of the step
    and the microbatch alone, never of which worker trains it, and two microbatches never share
    them (one key for all would repeat the same rounding noise in every microbatch, so that
    averaging K of them would not average the noise out)."""
    return jax.random.fold_in(state.sr_key(), index)


def share_sums(model, state, microbatches: Sequence[dict], *, first_index: int = 0, grad_fn=None):
    """(sum of per-token loss gradients, sum of per-token losses, token count) over one worker's
    microbatches, with the model's own loss (the eval step's), microbatch j keyed by
    `microbatch_key(state, first_index + j)`: `first_index` is the worker's first microbatch's
    position in the global batch. `grad_fn`: `share_grad_fn(model)`, when the caller keeps one."""
    grad_fn = grad_fn or share_grad_fn(model)
    grads = loss_sum = count = None
    for j, batch in enumerate(microbatches):
        keyed = state.replace(rng=microbatch_key(state, first_index + j))
        (loss, n), g = grad_fn(state.params, keyed, batch)
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


def update_fn(optimizer):
    """`update(state, grads)`: one optimizer step with the combined gradient, jitted."""

    @jax.jit
    def update(state, grads):
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                             opt_state=opt_state)

    return update


def split_shares(policy: BudgetPolicy, costs: Sequence[SiteCost], previous: Sequence[int] | None,
                 period_index: int) -> list[int]:
    """Microbatches per worker for the next period: `budget.allocate` over microbatches
    (`policy.quantum` = 1 microbatch, `total_samples` = K), at least one per worker."""
    if policy.quantum != 1:
        raise ValueError(f"quantum={policy.quantum}: a share is counted in microbatches, the quantum is 1")
    return allocate(policy, costs, previous, period_index)


def gather_combine(part):
    """`combine` across the processes of `jax.distributed`: every process's sums and count
    gathered (one row per process), added in the same order everywhere, divided once."""
    grads, loss_sum, count = part
    flat, unravel = ravel_pytree(grads)
    rows = multihost_utils.process_allgather(jnp.concatenate([flat, jnp.stack([loss_sum, count])]))
    total = rows.sum(axis=0)
    return unravel(jnp.asarray(total[:-2] / total[-1])), float(total[-2] / total[-1])


@dataclasses.dataclass
class Progress:
    """Where a shares run stands after a period, on every process alike: the state after `step`
    steps, the split the next period trains with, the workers' smoothed costs, and one decision
    record per period so far (`period_record`). A resume continues from it exactly."""

    step: int
    state: object
    split: list[int]
    costs: list[SiteCost]
    periods: list[dict]


def period_record(step: int, trained_with: Sequence[int], split: Sequence[int], busy_s: Sequence[float],
                  wall_s: Sequence[float], costs: Sequence[SiteCost]) -> dict:
    """One period's decision, as logged: the split it trained with, what the controller decided for
    the next (`microbatches`), each worker's busy and wall seconds (its idle time at the step
    barriers is the difference) and smoothed per-sample seconds."""
    return {"step": step, "trained_with": list(trained_with), "microbatches": list(split),
            "busy_s": [float(b) for b in busy_s], "wall_s": [float(w) for w in wall_s],
            "idle_s": [max(0.0, float(w) - float(b)) for b, w in zip(busy_s, wall_s)],
            "seconds_per_sample": [c.seconds_per_sample for c in costs]}


def train_shares(run, *, microbatch: int, initial: Sequence[int], steps: int, period: int,
                 slowdown: float = 1.0, slowdown_from: int = 0, policy: BudgetPolicy | None = None,
                 resume: Progress | None = None, on_period=None, log=print):
    """This process's part of a data-parallel run with per-process shares: each step it trains
    its share of `run`'s global batch, the shares combined token-weighted over the processes,
    one update applied on every process; every `period` steps the measured per-sample times
    (stretched by `slowdown` from step `slowdown_from` on, sleeping as the federated sites do) are
    gathered and the shares re-split identically on every process, one line logged and
    `on_period(progress, losses)` called. `resume`: a `Progress` to continue from (its state,
    split and costs). Returns (state, this call's per-step losses, shares per period)."""
    me, n = jax.process_index(), jax.process_count()
    split = list(resume.split if resume else initial)
    policy = policy or BudgetPolicy(total_samples=sum(split), quantum=1)
    data = run.dataset("train")
    state = resume.state if resume else run.init_state()

    grad_fn = share_grad_fn(run.model)
    update = update_fn(run.optimizer)

    # Compiled before the first measured step, so that the controller measures training, not
    # compilation (which `slowdown` would stretch too); then every process starts together.
    first_batch = data.batch(0)
    warm_up = {k: v[:microbatch] for k, v in first_batch.items()}
    jax.block_until_ready(grad_fn(state.params, state.replace(rng=microbatch_key(state, 0)), warm_up))
    multihost_utils.sync_global_devices("nvfp4_jax: shares compiled")

    first_step = resume.step if resume else 0
    costs = list(resume.costs) if resume else [SiteCost()] * n
    periods = list(resume.periods) if resume else []
    busy, done, losses, history = 0.0, 0, [], [list(split)]
    period_start = time.perf_counter()
    for step in range(first_step, steps):
        batch = data.batch(step)
        first = sum(split[:me])
        micro = [{k: v[(first + j) * microbatch:(first + j + 1) * microbatch] for k, v in batch.items()}
                 for j in range(split[me])]
        start = time.perf_counter()
        part = jax.block_until_ready(share_sums(run.model, state, micro, first_index=first, grad_fn=grad_fn))
        compute = time.perf_counter() - start
        stretch = slowdown if step >= slowdown_from else 1.0
        if stretch > 1.0:
            time.sleep(compute * (stretch - 1.0))
        busy += compute * stretch
        done += 1
        grads, loss = gather_combine(part)
        state = update(state, grads)
        losses.append(loss)
        if (step + 1) % period == 0 or step + 1 == steps:
            wall = time.perf_counter() - period_start
            measured = multihost_utils.process_allgather(np.asarray([busy, wall], np.float64))
            trained_with = list(split)
            costs = [smooth(c, float(row[0]), k * microbatch * done, None, policy.ema)
                     for c, row, k in zip(costs, measured, split)]
            split = split_shares(policy, costs, split, -(-(step + 1) // period))
            history.append(list(split))
            periods.append(period_record(step + 1, trained_with, split, measured[:, 0], measured[:, 1], costs))
            if on_period is not None:
                on_period(Progress(step + 1, state, list(split), list(costs), list(periods)), losses)
            log(f"shares: step={step + 1} microbatches={split} seconds_per_sample="
                f"[{', '.join(f'{c.seconds_per_sample:.4g}' for c in costs)}]")
            busy, done, period_start = 0.0, 0, time.perf_counter()
    return state, losses, history
