"""Resuming a run: which config changes a checkpoint allows, and where the new segment starts.

A rerun of the same command continues the run in its directory. Its config is compared with the
config stored in the newest checkpoint (`config_differences`, the one comparison in the code
base; the lab uses it too, ignoring only where a run lives): only `RESUME_MUTABLE_KEYS` may
differ, and the global batch must stay as it was. The data and tokenizer files must be those
whose fingerprint the checkpoint records (`check_data`; allow_data_change=true resumes anyway,
with a note). What the segment then does is `next_action`: train the remaining steps, or, when
the checkpoint is already at the last step, run the final evaluation that a stop during the
last step (or during that evaluation) left undone.

Nothing here imports jax at module level: the lab compares configs without it.
"""

from __future__ import annotations

import os
from typing import Any, Collection, Mapping

from nvfp4_jax.config import Config, ConfigError, ModelConfig, to_dict
from nvfp4_jax.data import fingerprint

# Keys a resumed run may change: they steer logging, checkpointing, profiling, where the run
# lives and how it is laid out on devices, not what it computes (the global batch is checked
# separately). `steps` stretches the learning-rate schedule from the resume on;
# `quantization_end_step` moves the BF16 tail. Decided for the three layout keys:
# `remat_policy` is bitwise-neutral and `num_vocab_tiling` changes only the order of the loss's
# sums, both with the same state tree, so a memory fix may be applied to a resumed run;
# `quantization_backend` runs the same numerics where the state trees agree (checked against
# the checkpoint's recorded backend by `check_backend`). README "Training" lists them all.
RESUME_MUTABLE_KEYS = (
    "steps", "log_period", "eval_interval", "eval_steps", "checkpoint_period",
    "max_checkpoints_to_keep", "checkpoint_fallback", "profiler",
    "profile_start_step", "profile_steps", "quantization_end_step", "run_name",
    "base_output_directory", "per_device_batch_size", "ici_data_parallelism",
    "ici_fsdp_parallelism", "dcn_data_parallelism", "coordinator_address", "num_processes",
    "process_id", "ici_context_parallelism", "dcn_context_parallelism", "ici_tensor_parallelism",
    "context_parallel_strategy",
    "remat_policy", "num_vocab_tiling",
    "quantization_backend",
    # Which forward pass evaluates: never what trains.
    "eval_quantization",
    # Where a fresh run's parameters came from (a resume restores its own checkpoint), and
    # whether metrics also go to TensorBoard.
    "load_parameters_path", "enable_tensorboard",
    # Threads that tokenize a document corpus at start-up; the batches do not depend on them.
    "grain_worker_count",
    # Whether a resume may continue on data files or a tokenizer that changed (never what the
    # files are: their fingerprint is compared by `check_data`).
    "allow_data_change",
)

# Where a run is, not what it is.
LOCATION_KEYS = ("run_name", "base_output_directory")

NOT_RECORDED = "(not recorded)"


class ResumeError(ConfigError):
    """The run directory holds checkpoints that this config may not continue."""


def config_differences(saved: Mapping[str, Any], cfg: Config, *,
                       ignore: Collection[str] = RESUME_MUTABLE_KEYS) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) for each key outside `ignore` that differs between a stored
    config (the `to_dict` form) and `cfg`, in `cfg`'s key order. A key present on one side only
    (a config from another version) counts as different, shown as NOT_RECORDED on the other."""
    old = {k: v for section in saved.values() if isinstance(section, Mapping) for k, v in section.items()}
    new = {k: v for section in to_dict(cfg).values() for k, v in section.items()}
    keys = list(new) + [k for k in old if k not in new]
    return [(k, old.get(k, NOT_RECORDED), new.get(k, NOT_RECORDED)) for k in keys
            if k not in ignore and old.get(k, NOT_RECORDED) != new.get(k, NOT_RECORDED)]


def check_backend(record: dict, backend, model_cfg: ModelConfig) -> None:
    """ConfigError when a checkpoint `record` was written by a backend whose state tree differs
    from that of `backend` (a `quant.BackendChoice`)."""
    # quant imports jax; this module stays jax-free at import (the lab)
    from nvfp4_jax import quant

    try:
        quant.check_backend_resume(record.get("quantization_backend"), backend.name, model_cfg.mlp_recipe)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def check_record(step: int, record: dict[str, Any], *, cfg: Config, run_dir: str, backend,
                 global_batch: int) -> None:
    """The resume guard: ResumeError (or ConfigError) unless `cfg` may continue checkpoint `step`
    of `run_dir`, whose JSON record is `record`."""
    saved = record.get("config")
    if not isinstance(saved, dict):
        raise ResumeError(f"Checkpoint step {step} in {run_dir} records no config; it was not "
                          "written by nvfp4_jax.train. Start a new run: run_name=<a new name>.")
    check_backend(record, backend, cfg.model)  # a state tree it cannot read
    diffs = config_differences(saved, cfg)
    saved_batch = record.get("global_batch_size")  # every checkpoint of the loop records it
    if saved_batch != global_batch:
        diffs.append(("global batch (per_device_batch_size x devices)", saved_batch, global_batch))
    if diffs:
        listing = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in diffs)
        raise ResumeError(
            f"{run_dir} holds checkpoint step {step} of a run with a different config, and "
            f"resuming would silently change it: {listing}. Only {', '.join(RESUME_MUTABLE_KEYS)} "
            "may change on resume. To train with these settings, start a new run: "
            "run_name=<a new name>."
        )


def check_data(step: int, record: dict[str, Any], current: dict[str, Any], *, allow_change: bool,
               run_dir: str) -> str | None:
    """The data guard: ResumeError when the data or tokenizer files differ from the fingerprint
    checkpoint `step` of `run_dir` recorded (`record["data_fingerprint"]`) and `allow_change`
    (allow_data_change) is off. Returns the note a resume prints instead, or None: with
    `allow_change`, or for a checkpoint that recorded no fingerprint (an older version)."""
    recorded = record.get("data_fingerprint")
    if not isinstance(recorded, dict) or recorded.get("format") != fingerprint.FORMAT:
        how = "no data fingerprint" if recorded is None else "a data fingerprint of another format"
        return (f"note: checkpoint step {step} records {how} (an older version wrote it), so this resume "
                "cannot check that its data and tokenizer files are unchanged; the checkpoints it "
                "saves record them.")
    diffs = fingerprint.compare(recorded, current)
    if allow_change:
        what = f"on changed data: {'; '.join(diffs)}" if diffs else "(the data and tokenizer are unchanged)"
        return f"note: allow_data_change=true: resuming checkpoint step {step} without the data check {what}."
    if diffs:
        raise ResumeError(
            f"{run_dir} holds checkpoint step {step}, trained on other data than this run would read: "
            f"{'; '.join(diffs)}. Put the data back, start a new run (run_name=<a new name>), or "
            "resume on the changed data with allow_data_change=true.")
    return None


def has_checkpoints(directory: str) -> bool:
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def check_checkpointing_off(ckpt_dir: str) -> None:
    """ResumeError when enable_checkpointing=false would start over beside existing checkpoints."""
    if has_checkpoints(ckpt_dir):
        raise ResumeError(
            f"{ckpt_dir} holds checkpoints, but enable_checkpointing=false would start the run "
            "over beside them. Resume with enable_checkpointing=true, or start a new run: "
            "run_name=<a new name>.")


def start_step(state) -> int:
    """The step a segment starts from: the restored (or fresh) state's own step counter."""
    # this module stays jax-free at import: the lab compares configs without it
    import jax

    return int(jax.device_get(state.step))
