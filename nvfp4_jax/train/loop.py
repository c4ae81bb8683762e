"""The training loop: `run(cfg)` trains, logs, evaluates, checkpoints and resumes.

The loop never waits for the device on the step it has just dispatched: it dispatches step n and
then reads step n-1's metrics. It waits for step n itself only before a checkpoint (so a
non-finite state is never saved) and at the end.

Each start of a run is a *segment*:
1. Everything a user can get wrong is checked before the disk is touched: the config (already
   valid), the mesh, the data.
2. The run directory is created and locked (`run_dir`): one process per run.
3. The newest intact checkpoint is restored onto the abstract sharded state (no fresh state is
   built first), after its stored config has been compared with this one (`resume`): only
   `resume.RESUME_MUTABLE_KEYS` may differ. A damaged checkpoint is set aside and the next newest
   one tried (`checkpoint_fallback`). A fresh state is initialised only when there is nothing to
   restore.
4. `config.json` is written, `metrics.jsonl` opened for this segment, and training runs.
5. SIGTERM or SIGINT (`shutdown`) finishes the current step, saves it, and ends the segment with
   `stopped_by` in the summary; rerunning the same command resumes exactly there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from nvfp4_jax.config import Config, ConfigError, to_dict
from nvfp4_jax.train import params_checkpoint as params_lib
from nvfp4_jax.flops import training_flops_per_step
from nvfp4_jax.quant import health
from nvfp4_jax.train import assembly, checkpoint, distributed, integrity, metrics as metrics_lib, resume
from nvfp4_jax.train import run_dir as run_dir_lib, shutdown, tensorboard
from nvfp4_jax.train.build import context_attention_warning


class NonFiniteError(RuntimeError):
    """A step's loss, gradient norm or new state was not finite; that state was not saved."""


ResumeError = resume.ResumeError
run_directory = run_dir_lib.path


class _Console:
    """The lead process's messages: progress to stdout (through the bar when there is one),
    warnings to stderr. Other processes stay quiet."""

    def __init__(self, is_lead: bool):
        self.is_lead = is_lead
        self.bar = None

    def info(self, msg: str) -> None:
        if self.is_lead:
            (self.bar.write(msg) if self.bar is not None else print(msg, flush=True))

    def warn(self, msg: str) -> None:
        if self.is_lead:
            print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Pending:
    step: int  # the step number reported (1-based: the state's step after the update)
    metrics: dict


def run(cfg: Config, *, progress: bool | None = None, devices=None) -> dict[str, Any]:
    """Trains according to `cfg`; returns (and writes) the run summary.

    `devices` restricts the mesh to a subset of `jax.devices()` (tests compare 1- and 8-way runs).
    Raises ConfigError, data_lib.DataError and run_dir.RunLockedError for what a user can fix
    (before anything compiles), NonFiniteError, checkpoint.CheckpointError when no intact
    checkpoint can be restored or a save fails, and run_dir.WriteError when metrics.jsonl,
    summary.json or config.json cannot be written (both name the intact checkpoint).
    """
    distributed.maybe_initialize(cfg.mesh)
    # The mesh, the batch checks and every start-up decision, once (nothing is traced yet).
    assembled = assembly.assemble(cfg, devices)
    if not resume.has_checkpoints(run_dir_lib.checkpoints(run_directory(cfg))):  # a resume ignores it
        params_lib.check_load_path(cfg.train.load_parameters_path, cfg.model)
    console = _Console(jax.process_index() == 0)
    datasets = {split: assembled.dataset(split) for split in ("train", "eval")}
    console.info(f"data: {datasets['train'].describe()}; {datasets['eval'].describe()}")
    for line in assembled.startup.lines():
        console.info(line)
    clash = context_attention_warning(cfg.model, assembled.mesh.shape["context"])
    if clash:
        console.warn(clash)
    for warning in dict.fromkeys(datasets["train"].warnings + datasets["eval"].warnings):
        console.warn(f"warning: {warning}")
    run_dir = run_dir_lib.create(cfg)
    if cfg.train.enable_checkpointing:  # before the lock, the restore and metrics.jsonl: nothing is touched
        problem = checkpoint.step_folder_problem(run_dir_lib.checkpoints(run_dir))
        if problem:
            raise ConfigError(f"{problem}: checkpoints cannot be kept there, and the run would start over. "
                              "Move it away (or start a new run: run_name=<a new name>).")
    lock = run_dir_lib.lock(run_dir, warn=console.warn) if console.is_lead else contextlib.nullcontext()
    with lock, shutdown.StopRequest(announce=console.warn) as stop:
        return _Segment(assembled, run_dir, datasets, console, stop, progress).run()


class _Segment:
    """One start of a run, from restore (or init) to the summary."""

    def __init__(self, assembled: assembly.Run, run_dir: str, datasets, console: _Console,
                 stop: shutdown.StopRequest, progress: bool | None):
        self.run_parts, self.cfg, self.mesh = assembled, assembled.cfg, assembled.mesh
        self.run_dir, self.console, self.stop = run_dir, console, stop
        self.progress = progress
        self.train_data, self.eval_data = datasets["train"], datasets["eval"]
        self.global_batch = assembled.global_batch
        self.backend = assembled.startup.backend
        self.manager = None
        self.last_good: tuple[int, bool] | None = None  # (step, verified) of the newest good checkpoint
        self.history: list[dict[str, Any]] = []
        self.eval_batches: list = []  # the same held-out batches every time: loaded once
        self.writer = None
        self.last_eval: dict[str, Any] = {}

    # --- resume ---------------------------------------------------------------------------

    def _check_resume(self, step: int, record: dict[str, Any]) -> None:
        resume.check_record(step, record, cfg=self.cfg, run_dir=self.run_dir, backend=self.backend,
                            global_batch=self.global_batch)

    def _restore_or_init(self):
        t = self.cfg.train
        ckpt_dir = run_dir_lib.checkpoints(self.run_dir)
        if not t.enable_checkpointing:
            resume.check_checkpointing_off(ckpt_dir)
            return self._fresh_state()
        self.manager = checkpoint.make_manager(ckpt_dir, max_to_keep=t.max_checkpoints_to_keep)
        abstract = self.run_parts.abstract_state

        def on_reject(step: int, why: str) -> None:
            then = "falling back to the next newest" if t.checkpoint_fallback else "stopping"
            self.console.warn(f"warning: checkpoint step {step} in {ckpt_dir} is damaged ({why}); {then}.")

        restored = checkpoint.restore_newest(
            self.manager, abstract, check_record=self._check_resume, fallback=t.checkpoint_fallback,
            on_reject=on_reject,
        )
        if restored is None:
            return self._fresh_state()
        if restored.rejected:
            self._set_aside([step for step, _ in restored.rejected])
        checkpoint.prune(self.manager, t.max_checkpoints_to_keep)  # a segment killed before its rotation
        self.last_good = (restored.step, restored.verified)
        how = "verified" if restored.verified else "UNVERIFIED: saved without checksums by an older version"
        self.console.info(f"Resumed from checkpoint step {restored.step} in {ckpt_dir} ({how}; data "
                          f"position: step {restored.record.get('data_step')}).")
        # What start-up decided differently this time (a resume may move to other devices).
        for decision, old, new in self.run_parts.startup.changes_from(restored.record.get("startup")):
            self.console.info(f"note: start-up decision {decision} was {old!r} at step {restored.step}, "
                              f"now {new!r}.")
        return restored.state

    def _fresh_state(self):
        """Step 0: initialised, with `load_parameters_path`'s parameters when it names some."""
        t = self.cfg.train
        state = self.run_parts.init_state(t.seed)
        if t.load_parameters_path:
            state = params_lib.load_into(t.load_parameters_path, state, self.run_parts.state_shardings)
            self.console.info(f"Parameters from load_parameters_path={t.load_parameters_path} "
                              "(fresh optimizer, step 0).")
        return state

    def _set_aside(self, steps: list[int]) -> None:
        destination = run_dir_lib.rejected(self.run_dir)
        if self.console.is_lead:
            for step in steps:
                where = checkpoint.set_aside(self.manager, step, destination)
                self.console.warn(f"warning: moved the damaged checkpoint step {step} to {where}.")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("nvfp4_jax: damaged checkpoints set aside")
        directory = str(self.manager.directory)
        self.manager.close()  # it still lists the moved steps
        self.manager = checkpoint.make_manager(directory, max_to_keep=self.cfg.train.max_checkpoints_to_keep)

    # --- per step ---------------------------------------------------------------------------

    def _put(self, dataset, step: int):
        """This process's rows of the global batch, assembled into one sharded array."""
        notice = dataset.notice(step)  # e.g. a new epoch of a document corpus
        if notice:
            self.console.info(notice)
        return self.run_parts.put(dataset.batch(step, jax.process_index(), jax.process_count()))

    def _last_good_text(self) -> str:
        if self.last_good is None:
            return "No checkpoint was saved."
        step, verified = self.last_good
        how = "finite and verified" if verified else "finite, saved without checksums"
        return f"The last good checkpoint is step {step} in {self.manager.directory} ({how})."

    def _report(self, p: _Pending) -> None:
        raw = jax.device_get(p.metrics)
        now = time.perf_counter()
        record = metrics_lib.step_record(p.step, now - self.last_time, raw, self.throughput)
        self.last_time = now
        if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
            raise NonFiniteError(
                f"Non-finite loss at step {p.step} (loss={record['loss']}, grad_norm={record['grad_norm']}); "
                f"stopping without saving. {self._last_good_text()}"
            )
        bad = integrity.first_non_finite(self.leaf_paths, raw["finite"])
        if bad is not None:
            raise NonFiniteError(
                f"Non-finite state after step {p.step}: {bad} is not finite (the step's loss "
                f"{record['loss']:.4f} was); stopping without saving it. {self._last_good_text()}"
            )
        self.history.append(record)
        if self.writer:
            self.writer.write(record)
        bar = self.console.bar
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}")
        t = self.cfg.train
        if p.step % t.log_period == 0 or p.step == t.steps or p.step == self.start + 1:
            self.console.info(metrics_lib.maxtext_line(record))

    def _evaluate(self, step: int, *, log: bool = True) -> float:
        """The validation loss of the state after `step`, through the forward pass the run trains
        with at this point (`eval_loss`; BF16 once the tail has begun) and/or through BF16 with
        the same weights (`eval_loss_bf16`), as `eval_quantization` asks. Returns the first.
        `log=False`: the file already holds this evaluation."""
        if not self.eval_batches:
            count, shortfall = self.eval_data.eval_limit(self.cfg.train.eval_steps)
            if shortfall:
                self.console.warn(f"warning: {shortfall}")
            self.eval_batches.extend(self._put(self.eval_data, i) for i in range(count))

        def loss_of(eval_step) -> float:
            return float(np.mean(jax.device_get([eval_step(self.state, b) for b in self.eval_batches])))

        mode = self.cfg.train.eval_quantization
        trains_quantized = self.quantizes_anything and self._quantizes(step)
        record: dict[str, Any] = {"step": step}
        if mode in ("train", "both"):
            record["eval_loss"] = loss_of(self.eval_step if trains_quantized else self._bf16_eval())
        if mode in ("bf16", "both"):
            # A run that is not quantizing now has one forward pass: evaluate it once.
            record["eval_loss_bf16"] = (record["eval_loss"] if "eval_loss" in record and not trains_quantized
                                        else loss_of(self._bf16_eval()))
        value = record.get("eval_loss", record.get("eval_loss_bf16"))
        perplexity = math.exp(min(value, 700))
        record["eval_perplexity"] = perplexity
        if self.writer and log:
            self.writer.write(record)
        extra = f", bf16 forward: {record['eval_loss_bf16']:.3f}" if mode == "both" else ""
        self.console.info(f"eval at step {step}{' (bf16 forward)' if mode == 'bf16' else ''}: "
                          f"loss: {value:.3f}, perplexity: {perplexity:.3f}{extra}")
        # Measured while the run still quantizes (the BF16 tail has nothing to measure).
        if self.stats_step is not None and self._quantizes(step):
            stats = health.flatten(jax.device_get(self.stats_step(self.state, self.eval_batches[0])))
            if self.writer and log:
                self.writer.write({"step": step, "quant_stats": stats})
        self.last_eval = record
        return value

    def _bf16_eval(self):
        """The eval step of the same parameters with BF16 dots, compiled on first use (a BF16 run
        evaluates with its only model)."""
        return self.run_parts.bf16_eval_step

    def _quantizes(self, step: int) -> bool:
        """Whether the step after `step` runs the quantized GEMMs (not yet the BF16 tail)."""
        end = self.cfg.train.quantization_end_step
        return end < 0 or step < end

    def _save(self, step: int) -> None:
        record = {"step": step, "data_step": step, "config": to_dict(self.cfg),
                  "global_batch_size": self.global_batch, "quantization_backend": self.backend.name,
                  "startup": self.run_parts.startup.record()}
        try:
            checkpoint.save(self.manager, self.state, record, max_to_keep=self.cfg.train.max_checkpoints_to_keep)
        except checkpoint.CheckpointError as exc:
            intact = self._last_good_text().replace("The last good", "The last good (and intact)")
            raise checkpoint.CheckpointError(f"{exc}. {intact}") from exc
        self.last_good = (step, True)

    def _stop_agreed(self, step: int) -> bool:
        """Whether every process has been asked to stop. Across processes the flag is exchanged
        at log_period steps only (a host round trip), so all of them stop at the same step."""
        if jax.process_count() == 1:
            return self.stop.requested
        if step % self.cfg.train.log_period:
            return False
        return bool(np.any(multihost_utils.process_allgather(np.int32(self.stop.requested))))

    # --- the segment ------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        try:
            try:
                summary = self._run()
            except run_dir_lib.WriteError as exc:
                raise run_dir_lib.WriteError(f"{exc}. {self._last_good_text()} Free some space (or fix the "
                                             "permissions) and rerun the same command to resume.") from exc
        except BaseException:
            # The error is what the user must see: a manager that fails to close after a failed
            # save or restore must not add its own traceback (orbax's event loop) after it.
            if self.manager is not None:
                with contextlib.suppress(Exception):
                    self.manager.close()
            raise
        if self.manager is not None:
            self.manager.close()
        return summary

    def _run(self) -> dict[str, Any]:
        cfg, t, m, parts = self.cfg, self.cfg.train, self.cfg.model, self.run_parts
        self.state = self._restore_or_init()
        self.start = resume.start_step(self.state)
        self.leaf_paths = integrity.leaf_paths(self.state)
        if self.console.is_lead:  # only now: a refused resume must leave the old config in place
            run_dir_lib.write_config(self.run_dir, cfg)
        train_step = parts.train_step
        self.eval_step = parts.eval_step
        # Decided once at start-up: whether a BF16 evaluation differs from this model's (nothing
        # quantized: the model is its own BF16 evaluation). The BF16 tail's step
        # (quantization_end_step) and the BF16 eval step are built on first use.
        self.quantizes_anything = parts.startup.quantizes_anything
        self.stats_step = parts.quant_stats_step if t.quant_stats else None
        self.throughput = metrics_lib.Throughput(
            flops_per_step=training_flops_per_step(m, self.global_batch, m.max_target_length),
            tokens_per_device_per_step=m.max_target_length * t.per_device_batch_size,
            num_devices=self.mesh.devices.size,
        )
        if self.console.is_lead:
            self.writer = run_dir_lib.MetricsWriter(self.run_dir, start=self.start)
            for note in self.writer.notes:
                (self.console.warn if note.startswith("warning:") else self.console.info)(note)
            self.writer = tensorboard.with_tensorboard(self.writer, cfg, self.run_dir, self.start, self.console.warn)
        if self.start >= t.steps:
            self.console.info(f"The run in {self.run_dir} is already at step {self.start} of steps={t.steps}: "
                              "nothing to train; evaluating it. Raise steps=... to continue it, or pick a new "
                              "run_name=...")
        if self.console.is_lead:
            self.console.bar = metrics_lib.progress_bar(self.start, t.steps, self.progress)
        self.last_time = time.perf_counter()
        reached, stopped_by, final_eval = self.start, None, None
        pending: _Pending | None = None
        profiling = False
        try:
            for step in range(self.start, t.steps):
                if t.profiler == "xplane" and step == t.profile_start_step and self.console.is_lead:
                    jax.profiler.start_trace(os.path.join(self.run_dir, "profile"))
                    profiling = True
                self.state, step_metrics = (train_step if self._quantizes(step) else parts.bf16_train_step)(
                    self.state, self._put(self.train_data, step))
                if pending is not None:
                    self._report(pending)
                pending = _Pending(step + 1, step_metrics)
                if profiling and step + 1 >= t.profile_start_step + t.profile_steps:
                    jax.block_until_ready(self.state)
                    jax.profiler.stop_trace()
                    profiling = False
                reached = step + 1
                stopping = self._stop_agreed(reached)
                if self.manager is not None and (reached % t.checkpoint_period == 0 or reached == t.steps
                                                 or stopping):
                    self._report(pending)  # never save a state whose step went non-finite
                    pending = None
                    self._save(reached)
                if stopping:
                    stopped_by = self.stop.signal_name or "a signal to another process"
                    break
                if reached % t.eval_interval == 0 and reached != t.steps:
                    self._evaluate(reached)
            if pending is not None:
                self._report(pending)
            if stopped_by is None:
                # A run is finished only when its final evaluation is recorded. A resume with
                # nothing left to train is one whose last segment stopped in its last step or
                # during that evaluation: it evaluates (every process, the same bits) and logs
                # the loss unless the file already has it.
                final_eval = self._evaluate(reached, log=reached > self.start or not (
                    self.writer and self.writer.has(reached, "eval_perplexity")))
            else:
                saved = f"saved checkpoint step {reached}" if self.manager is not None else "checkpointing is off"
                self.console.info(f"Stopped by {stopped_by} after step {reached} ({saved}); run the same "
                                  "command again to resume.")
        finally:
            if profiling:
                jax.profiler.stop_trace()
            if self.console.bar is not None:
                self.console.bar.close()
            if self.writer:
                self.writer.close()
        return self._summary(reached, final_eval, stopped_by)

    def _summary(self, reached: int, final_eval, stopped_by) -> dict[str, Any]:
        # The whole run, not just this segment: earlier segments' records come from the file
        # (which this segment's writer has just rewritten clean).
        records = run_dir_lib.read_metrics(self.run_dir) if self.console.is_lead else self.history
        train = sorted((r for r in records if "loss" in r), key=lambda r: r["step"])
        evals = sorted(run_dir_lib.iter_steps(records, "eval_loss"))
        evals_bf16 = sorted(run_dir_lib.iter_steps(records, "eval_loss_bf16"))
        final_bf16 = self.last_eval.get("eval_loss_bf16") if final_eval is not None else None
        steady = [r["tokens_per_device"] for r in self.history[1:]] or [r["tokens_per_device"] for r in self.history]
        summary = {
            "run_directory": os.path.abspath(self.run_dir),
            "steps": self.cfg.train.steps,
            "step_reached": reached,
            "stopped_by": stopped_by,
            "resumed_from_step": self.start or None,
            "segment": self.writer.segment if self.writer else None,
            "quantization": self.cfg.model.quantization or "bf16",
            "first_train_loss": train[0]["loss"] if train else None,
            "final_train_loss": train[-1]["loss"] if train else None,
            "eval_quantization": self.cfg.train.eval_quantization,
            # Through the forward pass eval_quantization names ("bf16": the BF16 one).
            "final_eval_loss": final_eval,
            "final_eval_loss_bf16": final_bf16,
            "median_tokens_per_second_per_device": statistics.median(steady) if steady else None,
            "median_step_seconds": (statistics.median([r["seconds"] for r in self.history[1:]])
                                    if len(self.history) > 1 else None),
            "eval_losses": evals,
            "eval_losses_bf16": evals_bf16,
            "last_checkpoint_step": self.last_good[0] if self.last_good else None,
        }
        if self.console.is_lead:
            run_dir_lib.write_summary(self.run_dir, summary)
        return summary


def format_summary(summary: dict[str, Any]) -> str:
    def fmt(v, spec=".4f"):
        return "n/a" if v is None else format(v, spec)

    if summary.get("stopped_by"):
        headline = (f"run stopped by {summary['stopped_by']} at step {summary['step_reached']} of "
                    f"{summary['steps']}, quantization={summary['quantization']} (rerun to resume)")
    else:
        headline = f"run finished: {summary['steps']} steps, quantization={summary['quantization']}"
    return "\n".join([
        "=" * 72,
        headline,
        f"  train loss: {fmt(summary['first_train_loss'])} (first step) -> "
        f"{fmt(summary['final_train_loss'])} (last step)",
        f"  validation loss: {fmt(summary['final_eval_loss'])}",
        f"  tokens/s/device (median): {fmt(summary['median_tokens_per_second_per_device'], '.1f')}",
        f"  run directory: {summary['run_directory']}",
        "=" * 72,
    ])
