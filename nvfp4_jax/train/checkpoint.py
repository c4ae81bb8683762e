"""Checkpoints with orbax: the whole TrainState plus a small JSON record, verified on restore.

The TrainState holds the model, optimizer state, FP8 amax histories, the step and the base key.
The data position is the step itself (batches are a pure function of (seed, split, step)), and
the JSON record stores it explicitly so a reader does not have to know that.

Three promises:
- Orbax writes each checkpoint into a temporary folder and renames it only once complete, so a
  crash or kill mid-save leaves the previous checkpoint as the latest one; the temporary
  leftovers are ignored on restore.
- `save` refuses a state with a non-finite leaf, so every checkpoint on disk is finite (and the
  newest one, which rotation never deletes, is always a good one).
- `save` records a checksum of every leaf (`integrity.checksums`, computed on device) in the
  record; `restore` recomputes them on the restored arrays, so a flipped bit anywhere in the
  saved arrays is found, not trained on. `restore_newest` falls back to the next newest intact
  checkpoint when the newest one cannot be read or does not verify.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from nvfp4_jax.train import integrity


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved, read, or trusted."""


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


def save(manager: ocp.CheckpointManager, state, record: dict[str, Any], *, max_to_keep: int | None = None) -> None:
    """Saves `state` at its step with `record` plus the state's per-leaf checksums, then keeps
    the newest `max_to_keep` checkpoints (`prune`).

    Raises CheckpointError, saving nothing, when a leaf is not finite, when orbax declines the
    step (a checkpoint of this or a later step already exists), or when the write fails (a full
    disk, a permission): the checkpoints saved before stay as they were.
    """
    step = int(jax.device_get(state.step))
    sums, finite = integrity.inspect(state)
    paths = integrity.leaf_paths(state)
    bad = integrity.first_non_finite(paths, finite)
    if bad is not None:
        raise CheckpointError(f"Refusing to save step {step}: {bad} is not finite.")
    record = {**record, "checksums": {p: [int(a), int(b)] for p, (a, b) in zip(paths, sums.tolist())}}
    try:
        saved = manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record))
        )
        manager.wait_until_finished()
    except Exception as exc:  # a full disk or a permission surfaces as OSError, or wrapped by tensorstore
        raise CheckpointError(f"Saving checkpoint step {step} in {manager.directory} failed ({_one_line(exc)})") from exc
    prune(manager, max_to_keep)
    if not saved:
        raise CheckpointError(
            f"Orbax did not save step {step} in {manager.directory}: it already holds step "
            f"{manager.latest_step()}."
        )


def prune(manager: ocp.CheckpointManager, max_to_keep: int | None) -> None:
    """Deletes the oldest checkpoints beyond `max_to_keep`, never the newest. Orbax rotates only
    after a save has committed, so a kill between its commit and its deletion, or a resume that
    only evaluates, would otherwise leave one checkpoint too many."""
    if not max_to_keep:
        return
    for step in sorted(manager.all_steps())[:-max_to_keep]:
        manager.delete(step)


def step_folder_problem(directory: str) -> str | None:
    """Why `directory` (a run's checkpoints/) cannot hold checkpoints, or None: it is not a
    folder, or a step's entry in it is not a folder (orbax would skip it without a word)."""
    if not os.path.lexists(directory):
        return None
    if not os.path.isdir(directory):
        return f"{directory} is not a directory"
    for name in sorted(os.listdir(directory)):
        if name.isdigit() and not os.path.isdir(os.path.join(directory, name)):
            return f"{os.path.join(directory, name)} is not a directory (checkpoint step {name} should be)"
    return None


def read_record(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The JSON record of `step` alone (config, data position, checksums), without the state."""
    try:
        restored = manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))
        record = restored.record
    except Exception as exc:  # orbax raises many types for damaged files
        raise CheckpointError(f"its record cannot be read ({_one_line(exc)})") from exc
    if not isinstance(record, dict):
        raise CheckpointError(f"its record is a {type(record).__name__}, not a mapping")
    return dict(record)


def verify(state, record: dict[str, Any]) -> bool:
    """Checks a restored state against its record's checksums, then for non-finite leaves.

    Returns False for a checkpoint saved without checksums (only finiteness can be checked);
    raises CheckpointError naming the first leaf that differs or is not finite.
    """
    sums, finite = integrity.inspect(state)
    paths = integrity.leaf_paths(state)
    expected = record.get("checksums")
    if expected is not None:
        if set(expected) != set(paths):
            differing = sorted(set(paths) ^ set(expected))[:3]
            raise CheckpointError(f"its leaves differ from the state's (e.g. {differing})")
        for path, got in zip(paths, sums.tolist()):
            if list(got) != list(expected[path]):
                raise CheckpointError(f"checksum mismatch in {path}: the saved bytes changed")
    bad = integrity.first_non_finite(paths, finite)
    if bad is not None:
        raise CheckpointError(f"{bad} is not finite")
    return expected is not None


def _restore_verified(manager: ocp.CheckpointManager, abstract_state, step: int):
    """(state, record, verified) of `step`; CheckpointError(why) when unreadable or not verified."""
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), record=ocp.args.JsonRestore()
            ),
        )
    except Exception as exc:  # orbax raises many types for damaged files
        raise CheckpointError(f"cannot be restored ({_one_line(exc)})") from exc
    record = dict(restored.record)
    return restored.state, record, verify(restored.state, record)


def restore(manager: ocp.CheckpointManager, abstract_state, step: int | None = None):
    """Restores onto `abstract_state`'s shapes, dtypes and shardings (any mesh) and verifies.

    Returns (state, record, verified). A checkpoint that cannot be read or fails verification
    raises CheckpointError naming its step and folder.
    """
    step = manager.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"No checkpoint in {manager.directory}.")
    try:
        return _restore_verified(manager, abstract_state, step)
    except CheckpointError as exc:
        raise CheckpointError(f"Checkpoint step {step} in {manager.directory}: {exc}.") from exc


@dataclasses.dataclass(frozen=True)
class Restored:
    state: Any
    record: dict[str, Any]
    step: int
    verified: bool  # False: saved without checksums (by an older version), restored unverified
    rejected: tuple[tuple[int, str], ...]  # (step, why) of newer checkpoints that were skipped


def restore_newest(
    manager: ocp.CheckpointManager,
    abstract_state,
    *,
    check_record: Callable[[int, dict[str, Any]], None],
    fallback: bool = True,
    on_reject: Callable[[int, str], None] = lambda step, why: None,
) -> Restored | None:
    """Restores the newest checkpoint that reads and verifies; None when there is none at all.

    For each step, newest first: read its record and pass it to `check_record` (which raises to
    stop, e.g. when the config differs), then restore and verify the state. A checkpoint that
    fails is reported through `on_reject(step, why)` and, with `fallback`, the next newest is
    tried; without it, or when every checkpoint fails, CheckpointError is raised. Nothing is
    moved or deleted here (see `set_aside`).
    """
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        return None
    rejected: list[tuple[int, str]] = []
    for step in steps:
        try:
            record = read_record(manager, step)
        except CheckpointError as exc:
            why = str(exc)
        else:
            check_record(step, record)
            try:
                state, record, verified = _restore_verified(manager, abstract_state, step)
                return Restored(state, record, step, verified, tuple(rejected))
            except CheckpointError as exc:
                why = str(exc)
        rejected.append((step, why))
        on_reject(step, why)
        if not fallback:
            raise CheckpointError(
                f"Checkpoint step {step} in {manager.directory} is damaged ({why}), and "
                "checkpoint_fallback=false forbids restoring an older one."
            )
    listing = "; ".join(f"step {s}: {w}" for s, w in rejected)
    raise CheckpointError(f"No intact checkpoint in {manager.directory} ({listing}).")


def set_aside(manager: ocp.CheckpointManager, step: int, destination: str) -> str:
    """Moves checkpoint `step` out of the manager's folder into `destination` (kept for
    inspection, never deleted). Orbax will not save a step at or below its newest one, so a
    rejected checkpoint must leave the folder before training continues below it."""
    os.makedirs(destination, exist_ok=True)
    target = os.path.join(destination, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(os.path.join(manager.directory, str(step)), target)
    return target


def silence_abandoned_reads() -> None:
    """Keeps the reads a failed restore abandons from printing tracebacks after the error line.

    When one array of a damaged checkpoint fails to read, orbax's restore returns at once and
    closes its event loop while tensorstore still reads the other arrays; each of those then
    reports `RuntimeError: Event loop is closed` as an unraisable exception (harmless: the
    restore has already failed). Only that exception is dropped; any other still prints."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    sys.unraisablehook = hook


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"

