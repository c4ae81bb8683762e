"""The training loop: `run(cfg)` trains, logs, evaluates, checkpoints and resumes.

The loop never waits for the device on the step it has just dispatched: it dispatches step n and
then reads step n-1's metrics. It waits for step n itself only before a checkpoint (so a
non-finite state is never saved) and at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from typing import Any

import jax
import numpy as np

from nvfp4_jax import data as data_lib
from nvfp4_jax import sharding
from nvfp4_jax.config import Config, save_json, to_dict
from nvfp4_jax.flops import training_flops_per_step
from nvfp4_jax.train import checkpoint, distributed, metrics as metrics_lib
from nvfp4_jax.quant import health
from nvfp4_jax.train.build import (
    build_model, init_state, jit_eval_step, jit_quant_stats_step, jit_train_step, state_shardings,
)
from nvfp4_jax.train.optimizer import make_optimizer


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) of a step was NaN or infinite."""


def run_directory(cfg: Config) -> str:
    name = cfg.train.run_name or f"{cfg.model.model_name}-{cfg.model.quantization or 'bf16'}"
    return os.path.join(cfg.train.base_output_directory, name)


@dataclasses.dataclass
class _Pending:
    step: int  # the step number reported (1-based: the state's step after the update)
    metrics: dict


def run(cfg: Config, *, progress: bool | None = None, devices=None) -> dict[str, Any]:
    """Trains according to `cfg`; returns (and writes) the run summary.

    `devices` restricts the mesh to a subset of `jax.devices()` (tests compare 1- and 8-way runs).
    """
    distributed.maybe_initialize(cfg.mesh)
    t, m = cfg.train, cfg.model
    mesh = sharding.make_mesh(cfg.mesh, devices)
    sharding.check_divisibility(cfg, mesh)
    num_devices = mesh.devices.size
    global_batch = t.per_device_batch_size * num_devices
    is_lead = jax.process_index() == 0

    run_dir = run_directory(cfg)
    os.makedirs(run_dir, exist_ok=True)
    if is_lead:
        save_json(cfg, os.path.join(run_dir, "config.json"))

    train_data = data_lib.make_dataset(
        cfg.data, seq_len=m.max_target_length, global_batch_size=global_batch, seed=t.seed,
        split="train", vocab_size=m.vocab_size,
    )
    eval_data = data_lib.make_dataset(
        cfg.data, seq_len=m.max_target_length, global_batch_size=global_batch, seed=t.seed,
        split="eval", vocab_size=m.vocab_size,
    )

    optimizer = make_optimizer(t)
    model = build_model(m, quantized=True)
    state, state_sh = init_state(model, optimizer, m.max_target_length, mesh, t.seed)
    batch_sh = sharding.batch_sharding(mesh)
    train_step = jit_train_step(model, optimizer, mesh, state_sh)
    # The BF16 tail (quantization_end_step) has the same parameters; its step is traced only
    # when first used, so the switch costs one compilation.
    bf16_step = (
        jit_train_step(build_model(m, quantized=False), optimizer, mesh, state_sh, uses_fp8_meta=False)
        if t.quantization_end_step >= 0
        else None
    )
    eval_step = jit_eval_step(model, mesh, state_sh)
    stats_step = jit_quant_stats_step(m, m.max_target_length, mesh, state_sh) if t.quant_stats else None

    manager = None
    last_saved: int | None = None
    if t.enable_checkpointing:
        manager = checkpoint.make_manager(
            os.path.join(run_dir, "checkpoints"), max_to_keep=t.max_checkpoints_to_keep
        )
        last_saved = checkpoint.latest_step(manager)
        if last_saved is not None:
            abstract, _ = state_shardings(model, optimizer, m.max_target_length, mesh)
            state, record = checkpoint.restore(manager, abstract)
            if is_lead:
                print(f"Resumed from checkpoint step {last_saved} in {manager.directory} "
                      f"(data position: step {record.get('data_step')}).", flush=True)

    def put(dataset, step: int):
        """This process's rows of the global batch, assembled into one sharded array."""
        local = dataset.batch(step, jax.process_index(), jax.process_count())
        return {k: jax.make_array_from_process_local_data(batch_sh, v) for k, v in local.items()}

    throughput = metrics_lib.Throughput(
        flops_per_step=training_flops_per_step(m, global_batch, m.max_target_length),
        tokens_per_device_per_step=m.max_target_length * t.per_device_batch_size,
        num_devices=num_devices,
    )
    if is_lead:
        print(f"data: {train_data.describe()}; {eval_data.describe()}", flush=True)
    writer = metrics_lib.MetricsWriter(os.path.join(run_dir, "metrics.jsonl")) if is_lead else None
    start = int(jax.device_get(state.step))
    if start >= t.steps and is_lead:
        print(f"The run in {run_dir} is already at step {start} of steps={t.steps}: nothing to train. "
              "Raise steps=... to continue it, or pick a new run_name=...", flush=True)
    bar = metrics_lib.progress_bar(start, t.steps, progress) if is_lead else None
    history: list[dict[str, Any]] = []
    eval_losses: list[tuple[int, float]] = []
    last_time = time.perf_counter()

    def report(p: _Pending) -> None:
        nonlocal last_time
        raw = jax.device_get(p.metrics)
        now = time.perf_counter()
        record = metrics_lib.step_record(p.step, now - last_time, raw, throughput)
        last_time = now
        if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
            where = (f"the last good checkpoint is step {last_saved} in {manager.directory}"
                     if manager is not None and last_saved is not None else "no checkpoint was saved")
            raise NonFiniteLossError(
                f"Non-finite loss at step {p.step} (loss={record['loss']}, "
                f"grad_norm={record['grad_norm']}); stopping. {where}."
            )
        history.append(record)
        if writer:
            writer.write(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}")
        if is_lead and (p.step % t.log_period == 0 or p.step == t.steps or p.step == start + 1):
            line = metrics_lib.maxtext_line(record)
            (bar.write(line) if bar is not None else print(line, flush=True))

    eval_batches: list = []  # the same held-out batches every time: loaded once, on first use

    def evaluate(step: int) -> float:
        if not eval_batches:
            eval_batches.extend(put(eval_data, i) for i in range(t.eval_steps))
        losses = [eval_step(state, batch) for batch in eval_batches]
        value = float(np.mean(jax.device_get(losses)))
        eval_losses.append((step, value))
        if writer:
            writer.write({"step": step, "eval_loss": value, "eval_perplexity": math.exp(min(value, 700))})
        # Measured while the run still quantizes (the BF16 tail has nothing to measure).
        if stats_step is not None and (bf16_step is None or step < t.quantization_end_step):
            stats = health.flatten(jax.device_get(stats_step(state, eval_batches[0])))
            if writer:
                writer.write({"step": step, "quant_stats": stats})
        if is_lead:
            msg = f"eval at step {step}: loss: {value:.3f}, perplexity: {math.exp(min(value, 700)):.3f}"
            (bar.write(msg) if bar is not None else print(msg, flush=True))
        return value

    pending: _Pending | None = None
    profiling = False
    try:
        for step in range(start, t.steps):
            if t.profiler == "xplane" and step == t.profile_start_step and is_lead:
                jax.profiler.start_trace(os.path.join(run_dir, "profile"))
                profiling = True
            use_bf16 = bf16_step is not None and step >= t.quantization_end_step
            state, step_metrics = (bf16_step if use_bf16 else train_step)(state, put(train_data, step))
            if pending is not None:
                report(pending)
            pending = _Pending(step + 1, step_metrics)
            if profiling and step + 1 >= t.profile_start_step + t.profile_steps:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
                profiling = False
            done = step + 1
            if manager is not None and (done % t.checkpoint_period == 0 or done == t.steps):
                report(pending)  # never save a state whose step went non-finite
                pending = None
                checkpoint.save(manager, state, {"step": done, "data_step": done, "config": to_dict(cfg)})
                last_saved = done
            if done % t.eval_interval == 0 and done != t.steps:
                evaluate(done)
        if pending is not None:
            report(pending)
        final_eval = evaluate(t.steps)
    finally:
        if profiling:
            jax.profiler.stop_trace()
        if bar is not None:
            bar.close()
        if writer:
            writer.close()

    steady = [r["tokens_per_device"] for r in history[1:]] or [r["tokens_per_device"] for r in history]
    summary = {
        "run_directory": os.path.abspath(run_dir),
        "steps": t.steps,
        "quantization": m.quantization or "bf16",
        "first_train_loss": history[0]["loss"] if history else None,
        "final_train_loss": history[-1]["loss"] if history else None,
        "final_eval_loss": final_eval,
        "median_tokens_per_second_per_device": statistics.median(steady) if steady else None,
        "median_step_seconds": statistics.median([r["seconds"] for r in history[1:]]) if len(history) > 1 else None,
        "eval_losses": eval_losses,
        "last_checkpoint_step": last_saved,
    }
    if is_lead:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    def fmt(v, spec=".4f"):
        return "n/a" if v is None else format(v, spec)

    return "\n".join([
        "=" * 72,
        f"run finished: {summary['steps']} steps, quantization={summary['quantization']}",
        f"  train loss: {fmt(summary['first_train_loss'])} (first step) -> "
        f"{fmt(summary['final_train_loss'])} (last step)",
        f"  validation loss: {fmt(summary['final_eval_loss'])}",
        f"  tokens/s/device (median): {fmt(summary['median_tokens_per_second_per_device'], '.1f')}",
        f"  run directory: {summary['run_directory']}",
        "=" * 72,
    ])
