"""The device mesh and the one table from logical axis names to mesh axes.

Layers name their parameters' axes logically (`embed`, `mlp`, ...; see nvfp4_jax.model); only this
module knows how those names land on the mesh. FSDP shards every parameter's `embed` axis (and
with it the optimizer state) over the `fsdp` mesh axis; the batch is split over `data` x `fsdp`.
Because the quantizer reduces its amax over the whole logical array inside `jit`, XLA inserts the
cross-device max itself: a sharded run quantizes bit-identically to a single-device one.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nvfp4_jax.config import ConfigError, Config, MeshConfig

MESH_AXES = ("data", "fsdp")

# Logical axis -> mesh axis (None: replicated). One table for every parameter and activation.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("embed", "fsdp"),
    ("vocab", None),
    ("mlp", None),
    ("heads", None),
    ("kv_heads", None),
    ("kv", None),
    ("q_heads_x_dim", None),
    ("kv_heads_x_dim", None),
    ("norm", None),
    ("layers", None),
    # Activations: split over the batch only (FSDP gathers weights, never activations).
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_mlp", None),
    ("activation_heads", None),
    ("activation_kv", None),
    ("activation_vocab", None),
    # The embedding lookup: tokens split over `data` only, the looked-up rows split along D over
    # `fsdp` like the table itself (see model.layers.Embed).
    ("activation_lookup_batch", "data"),
    ("activation_lookup_embed", "fsdp"),
)


def mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> tuple[int, int]:
    """(data, fsdp) sizes, with -1 filled in; a clear error when they do not fit the devices."""
    sizes = {
        "dcn_data_parallelism": mesh_cfg.dcn_data_parallelism,
        "ici_data_parallelism": mesh_cfg.ici_data_parallelism,
        "ici_fsdp_parallelism": mesh_cfg.ici_fsdp_parallelism,
    }
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
        raise ConfigError(
            "Mesh does not match the devices: dcn_data_parallelism * ici_data_parallelism * "
            f"ici_fsdp_parallelism = {sizes['dcn_data_parallelism']} * "
            f"{sizes['ici_data_parallelism']} * {sizes['ici_fsdp_parallelism']} = {total}, "
            f"but there are {num_devices} devices. Use -1 for one axis to take the rest."
        )
    return sizes["dcn_data_parallelism"] * sizes["ici_data_parallelism"], sizes["ici_fsdp_parallelism"]


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "fsdp") mesh. Devices are ordered host-major, so the data axis spans hosts."""
    devices = list(jax.devices() if devices is None else devices)
    data, fsdp = mesh_shape(mesh_cfg, len(devices))
    devices.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(data, fsdp), MESH_AXES)


def check_divisibility(cfg: Config, mesh: Mesh) -> None:
    """Sizes that the mesh must divide, checked before anything compiles."""
    fsdp = mesh.shape["fsdp"]
    if cfg.model.base_emb_dim % fsdp:
        raise ConfigError(
            f"base_emb_dim={cfg.model.base_emb_dim} is not divisible by the fsdp mesh axis "
            f"({fsdp}); FSDP shards the embedding axis."
        )


def logical_to_sharding(logical_specs, mesh: Mesh):
    """Pytree of logical PartitionSpecs -> pytree of NamedShardings."""
    import flax.linen as nn

    return nn.logical_to_mesh_sharding(logical_specs, mesh, LOGICAL_AXIS_RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def activation_sharding(mesh: Mesh):
    """Binds the model's logical activation constraints to `mesh` while a function is traced."""
    import flax.linen as nn

    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        yield


def sharded_jit(fn, mesh: Mesh, **jit_kwargs):
    """`jax.jit(fn, **jit_kwargs)`, called (and so traced) under `activation_sharding(mesh)`.

    The mesh is set around the call, not inside the traced function: `jax.set_mesh` may not be
    entered under `jit`.
    """
    jitted = jax.jit(fn, **jit_kwargs)

    @functools.wraps(fn)
    def call(*args):
        with activation_sharding(mesh):
            return jitted(*args)

    def lower(*args):
        with activation_sharding(mesh):
            return jitted.lower(*args)

    call.lower = lower  # for HLO inspection (benchmarks, tests)
    return call
