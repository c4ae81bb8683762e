"""The training state: everything a step reads and writes, and everything a checkpoint holds."""

from __future__ import annotations

from typing import Any

import flax
import jax


@flax.struct.dataclass
class TrainState:
    """`step` counts completed optimizer steps; `rng` is the run's base key (raw uint32[2]).

    `fp8_meta` maps each overwrite-with-gradient variable collection (delayed-scaling FP8 amax
    histories: ours, or Transformer Engine's) to its variables; empty for stateless recipes. It
    is updated by the overwrite-with-gradient rule, never by the optimizer.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    fp8_meta: Any
    rng: jax.Array

    def sr_key(self) -> jax.Array:
        """This step's stochastic-rounding key: differs every step, reproducible on resume."""
        return jax.random.fold_in(self.rng, self.step)
