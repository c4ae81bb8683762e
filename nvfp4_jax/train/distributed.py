"""Multi-host start-up: `jax.distributed.initialize` when the run spans processes."""

from __future__ import annotations

import os

import jax

from nvfp4_jax.config import MeshConfig

# Variables that say "this process is one of several" (JAX's own, and the common launchers').
_MULTI_PROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def wants_distributed(mesh_cfg: MeshConfig, environ=os.environ) -> bool:
    if mesh_cfg.coordinator_address or mesh_cfg.num_processes > 1:
        return True
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    for name in ("JAX_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(environ.get(name, "1") or 1) > 1:
            return True
    return False


def maybe_initialize(mesh_cfg: MeshConfig) -> bool:
    """Initialises JAX's multi-process runtime once, if the config or environment asks for it.

    Explicit config values win; anything left unset is read by JAX from its environment
    variables or the cluster (SLURM, Open MPI).
    """
    if not wants_distributed(mesh_cfg) or jax.distributed.is_initialized():
        return False
    kwargs = {}
    if mesh_cfg.coordinator_address:
        kwargs["coordinator_address"] = mesh_cfg.coordinator_address
    if mesh_cfg.num_processes > 0:
        kwargs["num_processes"] = mesh_cfg.num_processes
    if mesh_cfg.process_id >= 0:
        kwargs["process_id"] = mesh_cfg.process_id
    # CPU processes need a collectives library to talk to each other (GPUs use NCCL).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return True
