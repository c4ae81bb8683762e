"""A site's local training: this project's train step on the site's own data, for a sample budget.

`SiteTrainer` is built once per site, by the trainer's own builder (`nvfp4_jax.train.assembly`:
the same start-up decisions, model, state and jitted train step as `python -m nvfp4_jax.train`,
any quantization flag, any local mesh, e.g. FSDP over the site's 8 devices), and then trains from
each round's global model: it loads the received parameters into its state, runs
`budget / global_batch` steps of that train step, and returns its new
parameters. The site's optimizer state and its position in its data stay on the site between
rounds, so one site holding all the data, averaging only with itself, follows plain training.

The learning-rate schedule runs in global steps: the server gives each round a window of the
schedule, `[start, end)` (the steps a site with the nominal budget would take), and a site that
takes k local steps in it reads the schedule at `start + j * (end - start) // k` for its j-th
step, so a fast site with twice the budget takes smaller strides through the same window rather
than running ahead of the others (Adam's own step count stays the site's). Without a window the
schedule counts the site's local steps.

Heterogeneity for experiments: `slowdown` stretches the site's measured compute time by that
factor (the site sleeps for the difference, as a slower device would keep it busy). Energy is read
from the platform's counter where it has one (NVML on GPUs, RAPL on CPUs), else it is the stated
model `watts x busy seconds`; each round says which (`energy.py`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping

import jax
import numpy as np
import optax
from flax import traverse_util

from nvfp4_jax.config import Config
from nvfp4_jax.federated import energy as energy_lib
from nvfp4_jax.federated.contract import UpdateContract, trainable_paths
from nvfp4_jax.federated.budget import SiloPolicy
from nvfp4_jax.federated.silo import SiloShares
from nvfp4_jax.train import assembly
from nvfp4_jax.train import params_checkpoint as params_lib
from nvfp4_jax.train import vqa as vqa_lib

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


def initial_state(run: assembly.Run):
    """The run's fresh state with `load_parameters_path`'s parameters when it names some (a
    pretrained backbone): the server and every site start from the same model."""
    return params_lib.load_into(run.cfg.train.load_parameters_path, run.init_state(), run.state_shardings)


@dataclasses.dataclass
class RoundResult:
    params: dict[str, np.ndarray]  # the trainable leaves after the round
    steps: int
    samples: int
    seconds: float  # busy time (compute, stretched by the slowdown)
    joules: float | None
    train_loss: float | None
    energy_source: str | None = None  # "nvml" | "rapl" (a counter) | "model" (watts x seconds) | None


def schedule_positions(window: tuple[int, int], steps: int) -> list[int]:
    """Where each of `steps` local steps reads the learning-rate schedule in the round's global
    `window` `[start, end)`: evenly through it, `start + j * (end - start) // steps`."""
    start, end = (int(v) for v in window)
    if end < start:
        raise ValueError(f"schedule window {window}: end before start")
    return [start + j * (end - start) // steps for j in range(steps)]


def _with_schedule_count(opt_state, count: int):
    """`opt_state` with every schedule's step count (optax's `ScaleByScheduleState`) set to `count`,
    placed as the count it replaces is; other counts (Adam's bias correction) stay."""
    def set_count(node):
        if isinstance(node, optax.ScaleByScheduleState):
            return node._replace(count=jax.device_put(np.asarray(count, node.count.dtype), node.count.sharding))
        return node

    return jax.tree.map(set_count, opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByScheduleState))


class SiteTrainer:
    """One site's model, optimizer state, data position and jitted step."""

    def __init__(self, cfg: Config, contract: UpdateContract, *, devices=None, slowdown: float = 1.0,
                 watts: float | None = None, silo: SiloPolicy = SiloPolicy(),
                 device_slowdown: tuple[float, ...] | None = None):
        """`silo`: how a site of several devices shares a step between them (off: FSDP over them;
        else per-device shares, `silo.py`, each device's compute stretched by `device_slowdown`);
        a one-device site trains its train step either way."""
        if not slowdown >= 1.0:
            raise ValueError(f"slowdown={slowdown} must be >= 1 (a site cannot be faster than its device)")
        if device_slowdown and not silo.on:
            raise ValueError("device slowdowns stretch per-device shares: give the silo shares a policy")
        self.cfg, self.contract, self.slowdown, self.watts = cfg, contract, slowdown, watts
        run = assembly.assemble(cfg, devices)
        self.mesh, self.global_batch = run.mesh, run.global_batch
        site_devices = list(run.mesh.devices.flat)
        self.energy = energy_lib.RoundEnergy(
            energy_lib.site_meter(site_devices[0].platform,
                                  [getattr(d, "local_hardware_id", d.id) for d in site_devices]), watts)
        base = run.optimizer
        # The parameter paths decide which leaves train (a frozen backbone keeps the rest as received).
        self.paths = list(traverse_util.flatten_dict(run.abstract_state.params, sep=SEP))
        self.trainable = trainable_paths(contract, self.paths, cfg.model.base_num_decoder_layers)
        if contract.kind == "adapters" and contract.trainable == "all":
            if not run.adapters_only:
                raise ValueError("update=adapters trains the adapters alone: train_params must be auto or adapters")
        elif len(self.trainable) < len(self.paths):
            chosen = set(self.trainable)

            def labels(params):
                flat = traverse_util.flatten_dict(params, sep=SEP)
                return traverse_util.unflatten_dict(
                    {k: ("train" if k in chosen else "frozen") for k in flat}, sep=SEP)

            run = run.with_optimizer(optax.multi_transform({"train": base, "frozen": optax.set_to_zero()}, labels))
        self.run = run
        self.state = initial_state(run)
        self.data = run.dataset("train")
        self.data_step = 0  # the site's position in its own data, kept across rounds
        # The size of what this site trains on (FedAvg's weight); None for synthetic data.
        self.data_tokens = self.data.num_tokens
        self.silo = None
        if silo.on and (len(site_devices) > 1 or device_slowdown):
            self.silo = SiloShares(run, site_devices, silo, device_slowdown)
            self.silo.warm_up(self.state, self.data.batch(0))  # compiled here, as the train step below
        else:
            # Compiled here, so that a round's measured time (the budget controller's input) is
            # training, not compilation.
            self._step = run.train_step.lower(self.state, run.put(self.data.batch(0))).compile()
        self.silo_record = None  # the last round's per-device shares record (silo shares only)

    def initial_params(self) -> dict[str, np.ndarray]:
        return flat_params(self.state.params)

    def _batch(self):
        local = self.data.batch(self.data_step)
        self.data_step += 1
        return self.run.put(local)

    def train_round(self, global_params: Mapping[str, np.ndarray], samples: int,
                    schedule_window: tuple[int, int] | None = None) -> RoundResult:
        """Trains `samples` (a multiple of the site's global batch) from the global model, its
        learning-rate schedule read through the round's global `schedule_window` when given."""
        if samples % self.global_batch:
            raise ValueError(f"a budget of {samples} samples is not a multiple of this site's global batch "
                             f"{self.global_batch}")
        self.state = self.state.replace(params=_with_values(self.state.params, global_params))
        steps = samples // self.global_batch
        positions = schedule_positions(schedule_window, steps) if schedule_window is not None else None
        self.energy.start()
        start = time.perf_counter()
        losses = []
        for j in range(steps):
            if positions is not None:
                self.state = self.state.replace(opt_state=_with_schedule_count(self.state.opt_state, positions[j]))
            if self.silo is None:
                self.state, metrics = self._step(self.state, self._batch())
                losses.append(metrics["loss"])
            else:
                self.state, loss = self.silo.step(self.state, self.data.batch(self.data_step))
                self.data_step += 1
                losses.append(loss)
        losses = [float(x) for x in jax.device_get(losses)]
        compute = time.perf_counter() - start
        self.silo_record = self.silo.end_round() if self.silo is not None else None
        if self.slowdown > 1.0:
            time.sleep(compute * (self.slowdown - 1.0))
        seconds = compute * self.slowdown
        joules, energy_source = self.energy.joules(seconds)
        flat = flat_params(self.state.params)
        return RoundResult(
            params={k: flat[k] for k in self.trainable}, steps=steps, samples=samples, seconds=seconds,
            joules=joules, train_loss=float(np.mean(losses)) if losses else None, energy_source=energy_source,
        )


class Evaluator:
    """Validation loss of a flat parameter dict on a fixed set of held-out batches; for a VLM also
    its held-out question answering (`train/vqa.py`: every held-out question, greedy)."""

    # The VQA figures a round records (vqa_scores' others are per type or derived).
    VQA_KEYS = ("vqa_accuracy", "vqa_chance", "vqa_questions", "vqa_accuracy_by_type")

    def __init__(self, cfg: Config, *, devices=None, num_batches: int | None = None):
        run = assembly.assemble(cfg, devices)
        self.mesh, self.model = run.mesh, run.model
        self.state = initial_state(run)
        self.eval_fn = run.eval_step
        data = run.dataset("eval")
        self.vqa_data = data if cfg.model.model_type == "vlm" else None
        self.batches = [run.put(data.batch(i)) for i in range(num_batches or cfg.train.eval_steps)]

    def initial_params(self) -> dict[str, np.ndarray]:
        return flat_params(self.state.params)

    def loss(self, params: Mapping[str, np.ndarray]) -> float:
        state = self.state.replace(params=_with_values(self.state.params, params))
        losses = [self.eval_fn(state, b) for b in self.batches]
        return float(np.mean(jax.device_get(losses)))

    def scores(self, params: Mapping[str, np.ndarray]) -> dict:
        """{"validation_loss": ...}, and for a VLM `VQA_KEYS` of the held-out questions."""
        out = {"validation_loss": self.loss(params)}
        if self.vqa_data is not None:
            state = self.state.replace(params=_with_values(self.state.params, params))
            vqa = vqa_lib.vqa_scores(self.model, state, self.vqa_data)
            out.update({k: vqa[k] for k in self.VQA_KEYS})
        return out
