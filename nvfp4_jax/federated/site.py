"""A site's local training: this project's train step on the site's own data, for a sample budget.

`SiteTrainer` is built once per site (model, optimizer, mesh, the jitted train step) and then
trains from each round's global model: it loads the received parameters into its state, runs
`budget / global_batch` steps of the ordinary train step (`nvfp4_jax.train.build.jit_train_step`:
any quantization flag, any local mesh, e.g. FSDP over the site's 8 devices), and returns its new
parameters. The site's optimizer state and its position in its data stay on the site between
rounds, so one site holding all the data, averaging only with itself, follows plain training.

Heterogeneity for experiments: `slowdown` stretches the site's measured compute time by that
factor (the site sleeps for the difference, as a slower device would keep it busy), and energy is
a stated model, `watts x busy seconds`, where no power meter is read.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping

import jax
import numpy as np
import optax
from flax import traverse_util
from flax.linen import meta as nn_meta

from nvfp4_jax import data as data_lib
from nvfp4_jax import sharding
from nvfp4_jax.config import Config
from nvfp4_jax.federated.contract import UpdateContract, trainable_paths
from nvfp4_jax.train.build import build_model, init_state, jit_eval_step, jit_train_step
from nvfp4_jax.train.optimizer import make_optimizer

SEP = "/"


def flat_params(params) -> dict[str, np.ndarray]:
    """A parameter pytree as FLARE's NumPy exchange format: `{"path/to/leaf": float32 array}`."""
    flat = traverse_util.flatten_dict(jax.device_get(params), sep=SEP)
    return {k: np.asarray(v, np.float32) for k, v in flat.items()}


def _with_values(params, values: Mapping[str, np.ndarray]):
    """`params` (sharded jax arrays) with the leaves named in `values` replaced, each placed with
    its leaf's sharding; a shape mismatch is an error naming the leaf."""
    flat = traverse_util.flatten_dict(params, sep=SEP)
    unknown = set(values) - set(flat)
    if unknown:
        raise ValueError(f"the global model has parameters this site's model lacks: {sorted(unknown)[:3]}")
    out = {}
    for name, leaf in flat.items():
        if name in values:
            v = np.asarray(values[name])
            if v.shape != leaf.shape:
                raise ValueError(f"parameter {name}: the global model's shape {v.shape} != this site's {leaf.shape}")
            out[name] = jax.device_put(v.astype(leaf.dtype), leaf.sharding)
        else:
            out[name] = leaf
    return traverse_util.unflatten_dict(out, sep=SEP)


@dataclasses.dataclass
class RoundResult:
    params: dict[str, np.ndarray]  # the trainable leaves after the round
    steps: int
    samples: int
    seconds: float  # busy time (compute, stretched by the slowdown)
    joules: float | None
    train_loss: float | None


class SiteTrainer:
    """One site's model, optimizer state, data position and jitted step."""

    def __init__(self, cfg: Config, contract: UpdateContract, *, devices=None, slowdown: float = 1.0,
                 watts: float | None = None):
        if not slowdown >= 1.0:
            raise ValueError(f"slowdown={slowdown} must be >= 1 (a site cannot be faster than its device)")
        self.cfg, self.contract, self.slowdown, self.watts = cfg, contract, slowdown, watts
        self.mesh = sharding.make_mesh(cfg.mesh, devices)
        sharding.check_divisibility(cfg, self.mesh)
        self.global_batch = sharding.global_batch_size(cfg.train.per_device_batch_size, self.mesh.devices.size)
        self.model = build_model(cfg.model)
        base = make_optimizer(cfg.train)
        m = cfg.model
        seq_len = m.max_target_length
        # The parameter paths decide which leaves train (a frozen backbone keeps the rest as received).
        abstract = jax.eval_shape(lambda: self.model.init(
            {"params": jax.random.PRNGKey(0), "quant": jax.random.PRNGKey(0)},
            jax.numpy.zeros((1, seq_len), jax.numpy.int32))["params"])
        self.paths = list(traverse_util.flatten_dict(nn_meta.unbox(abstract), sep=SEP))
        self.trainable = trainable_paths(contract, self.paths, m.base_num_decoder_layers)
        if len(self.trainable) < len(self.paths):
            chosen = set(self.trainable)

            def labels(params):
                flat = traverse_util.flatten_dict(params, sep=SEP)
                return traverse_util.unflatten_dict(
                    {k: ("train" if k in chosen else "frozen") for k in flat}, sep=SEP)

            self.optimizer = optax.multi_transform({"train": base, "frozen": optax.set_to_zero()}, labels)
        else:
            self.optimizer = base
        state, self.state_sh = init_state(self.model, self.optimizer, seq_len, self.mesh, cfg.train.seed)
        self.state = state
        self.step_fn = jit_train_step(self.model, self.optimizer, self.mesh, self.state_sh)
        self.batch_sh = sharding.batch_sharding(self.mesh)
        self.data = data_lib.make_dataset(
            cfg.data, seq_len=m.max_target_length, global_batch_size=self.global_batch,
            seed=cfg.train.seed, split="train", vocab_size=m.vocab_size)
        self.data_step = 0  # the site's position in its own data, kept across rounds
        # Compiled here, so that a round's measured time (the budget controller's input) is
        # training, not compilation.
        example = {k: jax.device_put(v, self.batch_sh) for k, v in self.data.batch(0).items()}
        self._step = self.step_fn.lower(self.state, example).compile()

    def initial_params(self) -> dict[str, np.ndarray]:
        return flat_params(self.state.params)

    def _batch(self):
        local = self.data.batch(self.data_step)
        self.data_step += 1
        return {k: jax.device_put(v, self.batch_sh) for k, v in local.items()}

    def train_round(self, global_params: Mapping[str, np.ndarray], samples: int) -> RoundResult:
        """Trains `samples` (a multiple of the site's global batch) from the global model."""
        if samples % self.global_batch:
            raise ValueError(f"a budget of {samples} samples is not a multiple of this site's global batch "
                             f"{self.global_batch}")
        self.state = self.state.replace(params=_with_values(self.state.params, global_params))
        steps = samples // self.global_batch
        start = time.perf_counter()
        losses = []
        for _ in range(steps):
            self.state, metrics = self._step(self.state, self._batch())
            losses.append(metrics["loss"])
        losses = [float(x) for x in jax.device_get(losses)]
        compute = time.perf_counter() - start
        if self.slowdown > 1.0:
            time.sleep(compute * (self.slowdown - 1.0))
        seconds = compute * self.slowdown
        flat = flat_params(self.state.params)
        return RoundResult(
            params={k: flat[k] for k in self.trainable}, steps=steps, samples=samples, seconds=seconds,
            joules=None if self.watts is None else self.watts * seconds,
            train_loss=float(np.mean(losses)) if losses else None,
        )


class Evaluator:
    """Validation loss of a flat parameter dict on a fixed set of held-out batches."""

    def __init__(self, cfg: Config, *, devices=None, num_batches: int | None = None):
        self.mesh = sharding.make_mesh(cfg.mesh, devices)
        m = cfg.model
        self.model = build_model(m)
        optimizer = make_optimizer(cfg.train)
        self.state, state_sh = init_state(self.model, optimizer, m.max_target_length, self.mesh, cfg.train.seed)
        self.eval_fn = jit_eval_step(self.model, self.mesh, state_sh)
        global_batch = sharding.global_batch_size(cfg.train.per_device_batch_size, self.mesh.devices.size)
        data = data_lib.make_dataset(cfg.data, seq_len=m.max_target_length, global_batch_size=global_batch,
                                     seed=cfg.train.seed, split="eval", vocab_size=m.vocab_size)
        batch_sh = sharding.batch_sharding(self.mesh)
        n = num_batches or cfg.train.eval_steps
        self.batches = [{k: jax.device_put(v, batch_sh) for k, v in data.batch(i).items()} for i in range(n)]

    def initial_params(self) -> dict[str, np.ndarray]:
        return flat_params(self.state.params)

    def loss(self, params: Mapping[str, np.ndarray]) -> float:
        state = self.state.replace(params=_with_values(self.state.params, params))
        losses = [self.eval_fn(state, b) for b in self.batches]
        return float(np.mean(jax.device_get(losses)))
