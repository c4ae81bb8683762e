"""The training loop: `run(cfg)` trains, logs, evaluates, checkpoints and resumes.

The loop never waits for the device on the step it has just dispatched: it dispatches step n and
then reads step n-1's metrics. It waits for step n itself only before a checkpoint (so a
non-finite state is never saved) and at the end. `train` is that loop; what happens around each
step (metrics, checkpoints, evaluations, the profiler) is a hook (`hooks.py`).

Each start of a run is a *segment*:
1. Everything a user can get wrong is checked before the disk is touched: the config (already
   valid), the mesh, the data.
2. The run directory is created and locked (`run_dir`): one process per run.
3. The newest intact checkpoint is restored onto the abstract sharded state (no fresh state is
   built first), after its stored config has been compared with this one (`resume`): only
   `resume.RESUME_MUTABLE_KEYS` may differ, and its data fingerprint with the data and tokenizer
   files now (`data.fingerprint`; unless allow_data_change). A damaged checkpoint is set aside
   and the next newest one tried (`checkpoint_fallback`). A fresh state is initialised only when there is nothing to
   restore.
4. `config.json` is written, `metrics.jsonl` opened for this segment, and training runs.
5. SIGTERM or SIGINT (`shutdown`) finishes the current step, saves it, and ends the segment with
   `stopped_by` in the summary; rerunning the same command resumes exactly there.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from nvfp4_jax.config import Config, ConfigError, to_dict
from nvfp4_jax.data import fingerprint as fingerprint_lib
from nvfp4_jax.data.errors import DataError
from nvfp4_jax.flops import training_flops_per_step
from nvfp4_jax.train import assembly, checkpoint, distributed, hooks as hooks_lib, integrity, metrics as metrics_lib
from nvfp4_jax.train import params_checkpoint as params_lib, resume, run_dir as run_dir_lib, shutdown, tensorboard
from nvfp4_jax.train import vqa as vqa_lib
from nvfp4_jax.train.build import context_attention_warning
from nvfp4_jax.train.evaluation import Evaluation, quantizes_after
from nvfp4_jax.train.summary import SegmentOutcome, format_summary, summarize

NonFiniteError = hooks_lib.NonFiniteError
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


def train(state, step_fn: Callable[[int], Callable], batch_at: Callable[[int], dict],
          hooks: Sequence[hooks_lib.Hook], *, start: int, steps: int,
          stop_agreed: Callable[[int], bool]) -> tuple[Any, int, bool]:
    """Trains `state` from step `start` to `steps` (or until `stop_agreed(step)`): each step runs
    `step_fn(step)(state, batch_at(step))`; the hooks log, check, checkpoint, evaluate and profile
    around it (`hooks`). Step n's metrics are read only after step n+1 is dispatched, or when a
    hook flushes them. Returns the state, the steps done and whether it stopped early."""
    pending: tuple[int, dict] | None = None

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            (step, metrics), pending = pending, None
            for hook in hooks:
                hook.on_metrics(step, metrics)

    reached, stopping = start, False
    for step in range(start, steps):
        for hook in hooks:
            hook.before_step(step)
        state, step_metrics = step_fn(step)(state, batch_at(step))
        flush()
        pending = (step + 1, step_metrics)
        reached = step + 1
        stopping = stop_agreed(reached)
        end = hooks_lib.StepEnd(reached, state, stopping, reached == steps, flush)
        for hook in hooks:
            hook.after_step(end)
        if stopping:
            break
    flush()
    return state, reached, stopping


def place(run: assembly.Run, dataset, step: int, info: Callable[[str], None]) -> dict:
    """This process's rows of `dataset`'s global batch `step`, assembled into sharded arrays
    (saying first what the batch starts, e.g. a new epoch of a document corpus)."""
    notice = dataset.notice(step)
    if notice:
        info(notice)
    return run.put(dataset.batch(step, jax.process_index(), jax.process_count()))


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
    data_fingerprint = fingerprint_lib.fingerprint(cfg.data)  # what the files are now (resume.check_data)
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
        return _Segment(assembled, run_dir, datasets, data_fingerprint, console, stop, progress).run()


class _Segment:
    """One start of a run, from restore (or init) to the summary."""

    def __init__(self, assembled: assembly.Run, run_dir: str, datasets, data_fingerprint: dict[str, Any],
                 console: _Console, stop: shutdown.StopRequest, progress: bool | None):
        self.run_parts, self.cfg, self.mesh = assembled, assembled.cfg, assembled.mesh
        self.run_dir, self.console, self.stop = run_dir, console, stop
        self.progress = progress
        self.train_data, self.eval_data = datasets["train"], datasets["eval"]
        self.data_fingerprint = data_fingerprint
        self.data_notes: dict[int, str | None] = {}  # per checked checkpoint step: what check_data said
        self.global_batch = assembled.global_batch
        self.backend = assembled.startup.backend
        self.manager = None
        self.last_good: tuple[int, bool] | None = None  # (step, verified) of the newest good checkpoint

    # --- resume ---------------------------------------------------------------------------

    def _check_resume(self, step: int, record: dict[str, Any]) -> None:
        resume.check_record(step, record, cfg=self.cfg, run_dir=self.run_dir, backend=self.backend,
                            global_batch=self.global_batch)
        self.data_notes[step] = resume.check_data(step, record, self.data_fingerprint, run_dir=self.run_dir,
                                                  allow_change=self.cfg.data.allow_data_change)

    def _restore_or_init(self):
        t = self.cfg.train
        ckpt_dir = run_dir_lib.checkpoints(self.run_dir)
        if not t.enable_checkpointing:
            resume.check_checkpointing_off(ckpt_dir)
            return self._fresh_state()
        self.manager = checkpoint.make_manager(ckpt_dir, max_to_keep=t.max_checkpoints_to_keep)

        def on_reject(step: int, why: str) -> None:
            then = "falling back to the next newest" if t.checkpoint_fallback else "stopping"
            self.console.warn(f"warning: checkpoint step {step} in {ckpt_dir} is damaged ({why}); {then}.")

        restored = checkpoint.restore_newest(
            self.manager, self.run_parts.abstract_state, check_record=self._check_resume,
            fallback=t.checkpoint_fallback, on_reject=on_reject,
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
        if self.data_notes.get(restored.step):
            self.console.info(self.data_notes[restored.step])
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

    # --- what the hooks call ----------------------------------------------------------------

    def _last_good_text(self) -> str:
        if self.last_good is None:
            return "No checkpoint was saved."
        step, verified = self.last_good
        how = "finite and verified" if verified else "finite, saved without checksums"
        return f"The last good checkpoint is step {step} in {self.manager.directory} ({how})."

    def _save(self, step: int, state) -> None:
        record = {"step": step, "data_step": step, "config": to_dict(self.cfg),
                  "global_batch_size": self.global_batch, "quantization_backend": self.backend.name,
                  "startup": self.run_parts.startup.record(), "data_fingerprint": self.data_fingerprint}
        try:
            checkpoint.save(self.manager, state, record, max_to_keep=self.cfg.train.max_checkpoints_to_keep)
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

    def _eval_batches(self) -> list:
        count, shortfall = self.eval_data.eval_limit(self.cfg.train.eval_steps)
        if shortfall:
            self.console.warn(f"warning: {shortfall}")
        return [place(self.run_parts, self.eval_data, i, self.console.info) for i in range(count)]

    # --- the segment ------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        try:
            try:
                summary = self._run()
            except run_dir_lib.WriteError as exc:
                raise run_dir_lib.WriteError(f"{exc}. {self._last_good_text()} Free some space (or fix the "
                                             "permissions) and rerun the same command to resume.") from exc
            except DataError as exc:  # a record damaged mid-file, found when a batch reads it
                raise DataError(f"{exc} {self._last_good_text()} Fix the data (re-run `python -m "
                                "nvfp4_jax.data prepare ... --overwrite`) and rerun the same command to "
                                "resume.") from exc
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

    def _writer(self, start: int):
        """The lead process's metrics writer (metrics.jsonl, and TensorBoard when enabled)."""
        if not self.console.is_lead:
            return None
        writer = run_dir_lib.MetricsWriter(self.run_dir, start=start)
        for note in writer.notes:
            (self.console.warn if note.startswith("warning:") else self.console.info)(note)
        return tensorboard.with_tensorboard(writer, self.cfg, self.run_dir, start, self.console.warn)

    def _run(self) -> dict[str, Any]:
        cfg, t, m, parts = self.cfg, self.cfg.train, self.cfg.model, self.run_parts
        state = self._restore_or_init()
        start = resume.start_step(state)
        if self.console.is_lead:  # only now: a refused resume must leave the old config in place
            run_dir_lib.write_config(self.run_dir, cfg)
        writer = self._writer(start)
        evaluate = Evaluation(cfg, parts, self._eval_batches, writer, self.console.info)
        if start >= t.steps:
            self.console.info(f"The run in {self.run_dir} is already at step {start} of steps={t.steps}: "
                              "nothing to train; evaluating it. Raise steps=... to continue it, or pick a new "
                              "run_name=...")
        bar = metrics_lib.progress_bar(start, t.steps, self.progress) if self.console.is_lead else None
        self.console.bar = bar
        report = hooks_lib.Report(
            log_period=t.log_period, steps=t.steps, start=start, writer=writer, bar=bar, info=self.console.info,
            throughput=metrics_lib.Throughput(
                flops_per_step=training_flops_per_step(m, self.global_batch, m.max_target_length,
                                                       frozen_backbone=self.run_parts.adapters_only),
                tokens_per_device_per_step=m.max_target_length * t.per_device_batch_size,
                num_devices=self.mesh.devices.size),
            leaf_paths=integrity.leaf_paths(state), last_good=self._last_good_text)
        hooks: list[hooks_lib.Hook] = [report]
        if t.profiler == "xplane" and self.console.is_lead:
            hooks.append(hooks_lib.Profile(self.run_dir, t.profile_start_step, t.profile_steps))
        if self.manager is not None:
            hooks.append(hooks_lib.Checkpoint(t.checkpoint_period, self._save))
        hooks.append(hooks_lib.Evaluate(t.eval_interval, evaluate))
        final_eval = vqa = None
        try:
            state, reached, stopping = train(
                state, lambda step: parts.train_step if quantizes_after(cfg, step) else parts.bf16_train_step,
                lambda step: place(parts, self.train_data, step, self.console.info), hooks,
                start=start, steps=t.steps, stop_agreed=self._stop_agreed)
            stopped_by = (self.stop.signal_name or "a signal to another process") if stopping else None
            if stopped_by is None:
                # A run is finished only when its final evaluation is recorded. A resume with
                # nothing left to train is one whose last segment stopped in its last step or
                # during that evaluation: it evaluates (every process, the same bits) and logs
                # the loss unless the file already has it.
                final_eval = evaluate(reached, state, log=reached > start or not (
                    writer and writer.has(reached, "eval_perplexity")))
                if m.model_type == "vlm":
                    # Through the forward pass the run ends with (BF16 after quantization_end_step).
                    model = parts.model if quantizes_after(cfg, reached) else parts.bf16_model
                    vqa = vqa_lib.vqa_scores(model, state, self.eval_data)
                    self.console.info(f"held-out VQA at step {reached}: accuracy {vqa['vqa_accuracy']:.3f} "
                                      f"(chance {vqa['vqa_chance']:.3f}, {vqa['vqa_questions']} questions)")
            else:
                saved = f"saved checkpoint step {reached}" if self.manager is not None else "checkpointing is off"
                self.console.info(f"Stopped by {stopped_by} after step {reached} ({saved}); run the same "
                                  "command again to resume.")
        finally:
            for hook in reversed(hooks):
                hook.close()
        return summarize(cfg, self.run_dir, SegmentOutcome(
            start=start, reached=reached, stopped_by=stopped_by, final_eval=final_eval,
            final_eval_bf16=evaluate.last.get("eval_loss_bf16") if final_eval is not None else None,
            history=report.history, segment=writer.segment if writer else None,
            last_checkpoint_step=self.last_good[0] if self.last_good else None, vqa=vqa), is_lead=self.console.is_lead)


__all__ = ["NonFiniteError", "ResumeError", "format_summary", "run", "run_directory", "train"]
