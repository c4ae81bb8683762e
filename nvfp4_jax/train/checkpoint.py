"""Checkpoints with orbax: the whole TrainState plus a small JSON record.

The TrainState holds the model, optimizer state, FP8 amax histories, the step and the base key.
The data position is the step itself (batches are a pure function of (seed, split, step)), and
the JSON record stores it explicitly so a reader does not have to know that.

Orbax writes each checkpoint into a temporary folder and renames it only once complete, so a
crash or kill mid-save leaves the previous checkpoint as the latest one that restores; the
temporary leftovers are ignored on restore.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be restored."""


def make_manager(directory: str, *, max_to_keep: int, save_interval_steps: int = 1) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        save_interval_steps=save_interval_steps,
        create=True,
        # Checkpoints are small next to a step here; synchronous saves keep the
        # crash-consistency story simple (the rename happens before save() returns).
        enable_async_checkpointing=False,
    )
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save(manager: ocp.CheckpointManager, state, record: dict[str, Any], *, force: bool = False) -> bool:
    step = int(jax.device_get(state.step))
    saved = manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)),
        force=force,
    )
    manager.wait_until_finished()
    return saved


def latest_step(manager: ocp.CheckpointManager) -> int | None:
    return manager.latest_step()


def read_record(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The JSON record saved with checkpoint `step`, without restoring the state."""
    restored = manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))
    return dict(restored.record)


def restore(manager: ocp.CheckpointManager, abstract_state, step: int | None = None):
    """Restores onto `abstract_state`'s shapes, dtypes and shardings (any mesh).

    Returns (state, record). A damaged checkpoint raises CheckpointError naming its folder.
    """
    step = manager.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"No checkpoint in {manager.directory}.")
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), record=ocp.args.JsonRestore()
            ),
        )
    except Exception as exc:  # orbax raises many types for damaged files
        raise CheckpointError(
            f"Checkpoint step {step} in {manager.directory} cannot be restored "
            f"({type(exc).__name__}: {exc}). Delete that step's folder to fall back to an "
            "earlier checkpoint."
        ) from exc
    return restored.state, dict(restored.record)
