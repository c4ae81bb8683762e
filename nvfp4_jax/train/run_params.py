"""A run's parameters read back from its run directory: the newest intact checkpoint's, restored
on one device whatever mesh and batch the run trained with (its config: `run_dir.read_run_config`).
What `sample` answers with and what a federated job's `--backbone` starts from.
"""

from __future__ import annotations

import os
import sys

import jax

from nvfp4_jax.config import Config, ConfigError, MeshConfig
from nvfp4_jax.train import assembly, checkpoint


def newest_params(run_dir: str, cfg: Config, *, use: str = "sampling"):
    """(params, step) of the newest intact checkpoint, restored on one device; a damaged newer
    one is skipped with one warning line (`use`: what the parameters are for, in that line)."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        raise ConfigError(f"{run_dir!r} has no checkpoints/ folder (was enable_checkpointing=false?).")
    # The training run's state tree (FP8 histories included) is what the checkpoint holds; it is
    # restored on one device, whatever mesh and batch the run trained with.
    abstract = assembly.assemble(cfg, jax.devices()[:1], mesh_config=MeshConfig(), check_batch=False).abstract_state
    manager = checkpoint.make_manager(ckpt_dir, max_to_keep=cfg.train.max_checkpoints_to_keep)
    try:
        restored = checkpoint.restore_newest(manager, abstract, check_record=lambda step, record: None)
    finally:
        manager.close()
    if restored is None:
        raise ConfigError(f"{ckpt_dir} holds no checkpoint yet.")
    if restored.rejected:
        skipped = "; ".join(f"step {step} ({why})" for step, why in restored.rejected)
        print(f"warning: skipped the damaged checkpoint{'s' if len(restored.rejected) > 1 else ''} "
              f"{' '.join(skipped.split())} in {ckpt_dir}; {use} from step {restored.step}, the newest "
              "intact one.", file=sys.stderr, flush=True)
    return restored.state.params, restored.step
