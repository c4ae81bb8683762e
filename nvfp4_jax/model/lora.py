"""LoRA adapters: a trainable low-rank path beside a frozen projection.

A targeted projection computes `y = x W + (alpha / r) (x A) B` (`layers.Dense`): `W` is the
frozen fp32 kernel and goes through the projection's own dot (under NVFP4 the quantized GEMM,
unchanged), `A [K, r]` and `B [r, N]` are fp32 master weights multiplied in the compute dtype
with plain `lax.dot_general` (fp32 accumulation) and added to the base GEMM's fp32 output before
its one rounding. `B` starts at zero, so an adapted model starts as its backbone.

With the backbone frozen (`train_params=adapters`, the default under `lora_rank > 0`) the train
step differentiates the adapters alone (`split`, `train.step`): the frozen kernels get no weight
gradient, the optimizer keeps moments for the adapters only (`freeze_backbone`), gradient
clipping and the reported gradient norm cover the adapters. `merged` folds the adapters into the
kernels (`W + (alpha / r) A B` in fp32) for a model without them (export, `to-hf`).

Pure functions of parameter trees.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import optax

from nvfp4_jax.config import LORA_TARGETS, ModelConfig, TrainConfig

# The names of an adapter's two matrices under its projection.
ADAPTER_LEAVES = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """Rank, scale numerator and targeted projections of a model's adapters."""

    rank: int
    alpha: float
    targets: frozenset[str]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def rank_for(self, projection: str) -> int:
        """The adapter rank of the projection named `projection` (0: no adapter)."""
        return self.rank if projection in self.targets else 0


def from_config(model_cfg: ModelConfig) -> Adapter | None:
    """The adapters a (validated) `ModelConfig` asks for, or None (`lora_rank=0`)."""
    if not model_cfg.lora_rank:
        return None
    targets = frozenset(name.strip() for name in model_cfg.lora_targets.split(","))
    assert targets <= set(LORA_TARGETS), targets  # config.validate refused others
    return Adapter(model_cfg.lora_rank, model_cfg.lora_alpha, targets)


def trains_adapters_only(model_cfg: ModelConfig, train_cfg: TrainConfig) -> bool:
    """Whether the run trains its adapters alone (the backbone frozen): `train_params`
    `adapters`, or `auto` with adapters present."""
    if train_cfg.train_params == "auto":
        return model_cfg.lora_rank > 0
    return train_cfg.train_params == "adapters"


def _is_adapter(path) -> bool:
    last = path[-1]
    return getattr(last, "key", last) in ADAPTER_LEAVES


def freeze_backbone(optimizer):
    """`optimizer` on the adapters alone: its state covers the adapter matrices only (no Adam
    moments for the frozen backbone), it reads only their gradients (clipping included) and
    returns zero updates for every other parameter."""
    def init(params):
        return optimizer.init(split(params)[1])

    def update(updates, state, params=None):
        backbone_updates, adapter_updates = split(updates)
        adapter_params = None if params is None else split(params)[1]
        adapter_updates, state = optimizer.update(adapter_updates, state, adapter_params)
        return join(jax.tree.map(jnp.zeros_like, backbone_updates), adapter_updates), state

    return optax.GradientTransformation(init, update)


def split(params: Mapping) -> tuple[dict, dict]:
    """(backbone, adapters): the nested dict `params` cut in two trees of the same nesting,
    each holding only its own leaves (empty subtrees dropped)."""
    backbone, adapters = {}, {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            b, a = split(value)
            if b:
                backbone[key] = b
            if a:
                adapters[key] = a
        elif key in ADAPTER_LEAVES:
            adapters[key] = value
        else:
            backbone[key] = value
    return backbone, adapters


def join(backbone: Mapping, adapters: Mapping) -> dict:
    """The inverse of `split`."""
    out = dict(backbone)
    for key, value in adapters.items():
        out[key] = join(out.get(key, {}), value) if isinstance(value, Mapping) else value
    return out


def merged(params: Mapping, adapter: Adapter) -> dict:
    """`params` without adapters: each adapted kernel replaced by `W + scale * A @ B` in fp32
    (stacked layers multiply per layer). The merged model's outputs equal the adapted model's
    up to the compute dtype's rounding of the low-rank path."""
    out = {}
    for key, value in params.items():
        if not isinstance(value, Mapping):
            out[key] = value
        elif "lora_a" in value:
            a, b = jnp.asarray(value["lora_a"], jnp.float32), jnp.asarray(value["lora_b"], jnp.float32)
            kernel = jnp.asarray(value["kernel"], jnp.float32) + adapter.scale * jnp.matmul(a, b)
            out[key] = {k: v for k, v in value.items() if k not in ADAPTER_LEAVES} | {"kernel": kernel}
        else:
            out[key] = merged(value, adapter)
    return out


def count(params: Mapping) -> tuple[int, int]:
    """(adapter parameters, all parameters) of a params tree."""
    sizes = jax.tree_util.tree_flatten_with_path(params)[0]
    total = sum(math.prod(leaf.shape) for _, leaf in sizes)
    adapted = sum(math.prod(leaf.shape) for path, leaf in sizes if _is_adapter(path))
    return adapted, total
