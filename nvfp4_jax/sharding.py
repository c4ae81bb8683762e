"""The device mesh and the one table from logical axis names to mesh axes.

Layers name their parameters' axes logically (`embed`, `mlp`, ...; see nvfp4_jax.model); only this
module knows how those names land on the mesh. FSDP shards every parameter's `embed` axis (and
with it the optimizer state) over the `fsdp` mesh axis; the batch is split over `data` x `fsdp`,
the sequence over `context`, and attention heads and the MLP width over `tensor`.
Because the quantizer reduces its amax over the whole logical array inside `jit`, XLA inserts the
cross-device max itself: a sharded run quantizes bit-identically to a single-device one.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nvfp4_jax.config import Config, ConfigError, MeshConfig, _block_size, global_batch_size  # noqa: F401

# Outer to inner: the innermost axes get the closest devices (tensor parallelism talks most).
MESH_AXES = ("data", "fsdp", "context", "tensor")
# The mesh axes that split the batch (the rest replicate it).
BATCH_AXES = ("data", "fsdp")

# Logical axis -> mesh axis (None: replicated). One table for every parameter and activation.
# The mesh axes that shard every parameter's `embed` axis (ZeRO-3 style). The context axis joins
# fsdp, as in MaxText: its devices would otherwise hold the same weights and optimizer state.
PARAM_AXES = ("fsdp", "context")

LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("embed", PARAM_AXES),
    ("vocab", None),
    # Megatron-style tensor parallelism: Q/K/V and gate/up split their output columns over
    # `tensor`, out and down their input rows, so each block ends in one reduction over `tensor`.
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("q_heads_x_dim", "tensor"),
    ("kv_heads_x_dim", "tensor"),
    ("norm", None),
    ("layers", None),
    ("lora_rank", None),  # an adapter's rank: small, never split
    ("patch", None),  # the vision encoder's patch pixels and image positions: small, never split
    ("image_tokens", None),
    # Activations: split over the batch (FSDP gathers weights, never activations), along the
    # sequence over `context` (norms, residuals, MLP and loss run on sequence shards), and
    # their heads / MLP width over `tensor`.
    ("activation_batch", BATCH_AXES),
    ("activation_length", "context"),
    ("activation_embed", None),
    ("activation_mlp", "tensor"),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_vocab", None),
    # The embedding lookup: tokens split over `data` only and whole along the sequence, the
    # looked-up rows split along D over fsdp x context like the table itself (model.layers.Embed).
    ("activation_lookup_batch", "data"),
    ("activation_lookup_length", None),
    ("activation_lookup_embed", PARAM_AXES),
)


class MeshShape(NamedTuple):
    data: int
    fsdp: int
    context: int
    tensor: int


MESH_KEYS = ("dcn_data_parallelism", "ici_data_parallelism", "ici_fsdp_parallelism",
              "dcn_context_parallelism", "ici_context_parallelism", "ici_tensor_parallelism")


def mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> MeshShape:
    """(data, fsdp, context, tensor) sizes, with -1 filled in; a clear error when they do not fit."""
    sizes = {key: getattr(mesh_cfg, key) for key in MESH_KEYS}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"At most one mesh axis may be -1; got -1 for {free}.")
    known = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if num_devices % known:
            raise ConfigError(
                f"Cannot fill {free[0]}=-1: the other mesh axes multiply to {known}, which does not "
                f"divide the {num_devices} devices."
            )
        sizes[free[0]] = num_devices // known
    total = math.prod(sizes.values())
    if total != num_devices:
        named = [k for k in MESH_KEYS if sizes[k] != 1 or k == "ici_fsdp_parallelism"]
        raise ConfigError(
            f"Mesh does not match the devices: {' * '.join(named)} = "
            f"{' * '.join(str(sizes[k]) for k in named)} = {total}, "
            f"but there are {num_devices} devices. Use -1 for one axis to take the rest."
        )
    return MeshShape(
        sizes["dcn_data_parallelism"] * sizes["ici_data_parallelism"], sizes["ici_fsdp_parallelism"],
        sizes["dcn_context_parallelism"] * sizes["ici_context_parallelism"], sizes["ici_tensor_parallelism"],
    )


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "fsdp", "context", "tensor") mesh. Devices are ordered host-major, so the data
    axis spans hosts first (a dcn_context_parallelism > 1 context axis spans them too only when
    data and fsdp are 1)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    devices.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(tuple(shape)), MESH_AXES)


def check_divisibility(cfg: Config, mesh: Mesh, num_devices: int | None = None) -> None:
    """Sizes that the mesh must divide, checked before anything compiles."""
    shape = MeshShape(*(mesh.shape[a] for a in MESH_AXES))
    check_mesh_sizes(cfg, shape, num_devices or mesh.devices.size)


def check_mesh_sizes(cfg: Config, shape: MeshShape, num_devices: int) -> None:
    """`check_divisibility` on mesh sizes alone (plan uses it without devices)."""
    m = cfg.model
    if m.base_emb_dim % shape.fsdp:
        raise ConfigError(
            f"base_emb_dim={m.base_emb_dim} is not divisible by the fsdp mesh axis "
            f"({shape.fsdp}); FSDP shards the embedding axis."
        )
    if m.base_emb_dim % (shape.fsdp * shape.context):
        raise ConfigError(
            f"base_emb_dim={m.base_emb_dim} is not divisible by fsdp x context = {shape.fsdp} x "
            f"{shape.context}: parameters shard their embedding axis over both."
        )
    batch = global_batch_size(cfg.train.per_device_batch_size, num_devices)
    splits = shape.data * shape.fsdp
    if batch % splits:
        raise ConfigError(
            f"per_device_batch_size={cfg.train.per_device_batch_size:g} gives a global batch of {batch} "
            f"sequences, which data x fsdp = {shape.data} x {shape.fsdp} devices cannot split evenly; "
            "ici_context_parallelism and ici_tensor_parallelism share sequences instead."
        )
    if m.quantization_backend == "te" and shape.context * shape.tensor > 1:
        raise ConfigError(
            f"quantization_backend=te with ici_context_parallelism x ici_tensor_parallelism = "
            f"{shape.context} x {shape.tensor}: Transformer Engine is told only the data and fsdp axes "
            "(its amax would miss the others); use quantization_backend=emulated or xla."
        )
    _check_context(m, shape.context)
    _check_tensor(m, shape.tensor, shape.context)


def _check_context(m, context: int) -> None:
    L = m.max_target_length
    if context == 1:
        return
    if L % context:
        raise ConfigError(
            f"max_target_length={L} is not divisible by the context parallelism ({context}): "
            "each device holds an equal shard of the sequence."
        )
    block = _block_size(m.quantization)
    if block and (L // context) % block:
        raise ConfigError(
            f"max_target_length={L} / context parallelism {context} = {L // context} tokens per shard, "
            f"not a multiple of {block}: quantization={m.quantization!r} blocks (and Hadamard-"
            "transforms) the tokens of each shard in groups of that size."
        )


def _check_tensor(m, tensor: int, context: int) -> None:
    H, G = m.base_num_query_heads, m.base_num_kv_heads
    if H % tensor or G % tensor:
        raise ConfigError(
            f"base_num_query_heads={H} and base_num_kv_heads={G} must both be divisible by "
            f"ici_tensor_parallelism={tensor}: tensor parallelism splits whole heads."
        )
    if m.base_mlp_dim % tensor:
        raise ConfigError(f"base_mlp_dim={m.base_mlp_dim} is not divisible by ici_tensor_parallelism={tensor}.")
    block = _block_size(m.quantization)
    if tensor > 1 and block and (m.base_mlp_dim // tensor) % block:
        raise ConfigError(
            f"base_mlp_dim={m.base_mlp_dim} / ici_tensor_parallelism={tensor} = {m.base_mlp_dim // tensor} "
            f"per shard, not a multiple of {block}: quantization={m.quantization!r}'s weight tiles "
            "must not straddle a tensor-parallel shard."
        )
    if context > 1 and m.context_parallel_strategy == "ulysses" and (H // tensor) % context:
        raise ConfigError(
            f"context_parallel_strategy=ulysses needs base_num_query_heads={H} (/ ici_tensor_parallelism="
            f"{tensor}) divisible by the context parallelism {context}: each device attends with a "
            "whole share of the heads (or use context_parallel_strategy=all_gather)."
        )


def logical_to_sharding(logical_specs, mesh: Mesh):
    """Pytree of logical PartitionSpecs -> pytree of NamedShardings."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, LOGICAL_AXIS_RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, L] token arrays: rows over data x fsdp, the sequence over context."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, "context"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def activation_sharding(mesh: Mesh):
    """Binds the model's logical activation constraints to `mesh` while a function is traced."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        yield


def sharded_jit(fn, mesh: Mesh, **jit_kwargs):
    """`jax.jit(fn, **jit_kwargs)`, called (and so traced) under `activation_sharding(mesh)`.

    The mesh is set around the call, not inside the traced function: `jax.set_mesh` may not be
    entered under `jit`.
    """
    return within(lambda: activation_sharding(mesh), jax.jit(fn, **jit_kwargs))


def within(context, step):
    """`step` (a jitted callable) and its `.lower` (for HLO inspection: benchmarks, tests),
    each called inside a fresh `context()`."""

    @functools.wraps(step)
    def call(*args):
        with context():
            return step(*args)

    def lower(*args):
        with context():
            return step.lower(*args)

    call.lower = lower
    return call
