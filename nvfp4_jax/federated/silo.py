"""Per-device shares inside a silo: a site's devices as data-parallel workers of unequal shares.

The hierarchical regime (HFL-DDP): FedAvg between sites, data parallel inside a site. Without this,
a site of K devices trains FSDP over them and every device gets the same `per_device_batch_size`
rows. With it (`--silo-shares equal|static|adaptive`), every step the site's batch (the same
`per_device_batch_size x K` rows) is cut into microbatches of `--silo-microbatch` rows, device d
trains k_d of them (sum k_d = the step's microbatches, k_d >= 1, static shapes: no padding, no
dummy rows), and the gradient is the whole batch's token-weighted mean (`shares.share_sums` on
each device, `shares.combine` of the sums, one optimizer update of the site's state). At every
round's end the shares are re-split by the budget controller (`budget.allocate` over microbatches:
EMA of each device's measured per-sample time, the deadband, at least one microbatch a device),
the same controller that splits the round's samples between the sites (the policy,
`budget.SiloPolicy`, and its checks are there too); the site's own measured
round time then sets its between-site budget.

Every device's share is dispatched before any is awaited, so the devices compute concurrently, and
each device's compute time is when its sums are ready. Heterogeneity for experiments: device d's
compute is stretched by `slowdown[d]`, and the step waits for the slowest device (the site sleeps
for the difference, as the sites and the `ddp` workers do). On CPU the "devices" of
`--xla_force_host_platform_device_count` share the machine's cores, so their measured times are
what the cores give each, not independent devices'.

Quantized runs key each microbatch's stochastic rounding by its position in the site's batch
(`shares.microbatch_key`), so a split never changes a microbatch's gradient bits. Delayed-scaling
FP8 is refused: its amax histories are state a shares step does not carry.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Sequence

import jax

from nvfp4_jax.federated import shares
from nvfp4_jax.federated.budget import BudgetPolicy, SiloPolicy, SiteCost, allocate, check_silo, smooth


class SiloShares:
    """One site's devices training unequal shares of its step batch; `step` trains one step,
    `end_round` re-splits and returns the round's per-device record."""

    def __init__(self, run, devices: Sequence[jax.Device], policy: SiloPolicy,
                 slowdown: Sequence[float] | None = None):
        if jax.tree.leaves(run.state_shardings.fp8_meta):
            raise ValueError("silo shares: delayed-scaling FP8 keeps amax histories a shares step does not "
                             "carry; use a stateless recipe (te_nvfp4, fp8 current scaling, bf16)")
        self.run, self.devices, self.policy = run, list(devices), policy
        k = len(self.devices)
        self.slowdown = [1.0] * k if slowdown is None else [float(f) for f in slowdown]
        if len(self.slowdown) != k or not all(f >= 1.0 for f in self.slowdown):
            raise ValueError(f"device slowdowns {list(self.slowdown)}: one factor >= 1 for each of the {k} devices")
        self.microbatches = check_silo(policy, k, run.global_batch)
        self.controller = BudgetPolicy(name=policy.name, total_samples=self.microbatches, quantum=1,
                                       ema=policy.ema, deadband=policy.deadband)
        self.costs = [SiteCost()] * k
        self.split = allocate(self.controller, self.costs, None, 0)
        self.rounds = 0
        self.grad_fn = shares.share_grad_fn(run.model)
        self.update = shares.update_fn(run.optimizer)
        self._param_shardings = run.state_shardings.params
        self._pool = concurrent.futures.ThreadPoolExecutor(k)
        self._busy, self._wall, self._steps = [0.0] * k, 0.0, 0

    def _parts(self, state, local_batch: dict):
        """Every device's (gradient sums, loss sum, token count), dispatched device by device and
        awaited together; each device's compute seconds (from the common start to its sums)."""
        m = self.policy.microbatch
        light = state.replace(opt_state=None)  # what the gradient needs: not the optimizer's moments
        start = time.perf_counter()
        parts, first = [], 0
        for device, k in zip(self.devices, self.split):
            on_device = jax.device_put(light, device)
            micro = [jax.device_put({name: v[(first + j) * m:(first + j + 1) * m] for name, v in local_batch.items()},
                                    device) for j in range(k)]
            parts.append(shares.share_sums(self.run.model, on_device, micro, first_index=first,
                                           grad_fn=self.grad_fn))
            first += k

        def ready(part):
            jax.block_until_ready(part)
            return time.perf_counter() - start

        return parts, list(self._pool.map(ready, parts)), start

    def _apply(self, state, parts):
        home = self.devices[0]
        grads, loss = shares.combine([jax.device_put(p, home) for p in parts])
        return self.update(state, jax.device_put(grads, self._param_shardings)), loss

    def warm_up(self, state, local_batch: dict) -> None:
        """Compiles what a step runs (every device's gradient, the combination, the update) on
        one batch, changing nothing: a round's measured times are training, not compilation."""
        parts, _, _ = self._parts(state, local_batch)
        jax.block_until_ready(self._apply(state, parts))

    def step(self, state, local_batch: dict):
        """One step of the site's batch (`local_batch`, NumPy rows) over the devices' shares:
        (the new state, the batch's mean loss)."""
        parts, compute, start = self._parts(state, local_batch)
        busy = [c * f for c, f in zip(compute, self.slowdown)]
        # The step's barrier: it ends when the slowest (stretched) device is done.
        wait = max(busy) - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        state, loss = self._apply(state, parts)
        self._busy = [a + b for a, b in zip(self._busy, busy)]
        self._wall += time.perf_counter() - start
        self._steps += 1
        return state, loss

    def end_round(self) -> dict:
        """The round's per-device record (the shares it trained with, each device's busy, wall and
        idle seconds and smoothed per-sample seconds, the shares decided for the next round), and
        the re-split."""
        trained_with = list(self.split)
        m = self.policy.microbatch
        if self._steps:
            self.costs = [smooth(c, busy, k * m * self._steps, None, self.controller.ema)
                          for c, busy, k in zip(self.costs, self._busy, trained_with)]
        self.rounds += 1
        self.split = allocate(self.controller, self.costs, trained_with, self.rounds)
        record = {
            "policy": self.policy.name, "microbatch": m, "trained_with": trained_with,
            "microbatches": list(self.split), "busy_s": [float(b) for b in self._busy],
            "idle_s": [max(0.0, self._wall - b) for b in self._busy], "wall_s": float(self._wall),
            "slowdown": list(self.slowdown), "seconds_per_sample": [c.seconds_per_sample for c in self.costs],
        }
        self._busy, self._wall, self._steps = [0.0] * len(self.devices), 0.0, 0
        return record

