"""What happens around each training step, as hooks of the loop (`loop.train`).

The loop dispatches step n and only then reads step n-1's metrics, so it never waits for the
device on the step it has just dispatched. Each hook sees:
- `before_step(step)`: step `step` (0-based) is about to be dispatched;
- `on_metrics(step, metrics)`: the metrics of step `step` (1-based, the state's step after
  the update) have been read back; `Report` logs them and stops on a non-finite one;
- `after_step(end)`: step `end.step` has been dispatched; `end.flush()` reads its metrics now,
  which a hook must call before it reads or saves `end.state` (a non-finite state is never
  saved);
- `close()`: the segment is over (also after an error).

The hooks here call the robustness modules (`checkpoint`, `integrity`, `run_dir`, `metrics`);
they decide only when.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable

import jax

from nvfp4_jax.train import integrity, metrics as metrics_lib


class NonFiniteError(RuntimeError):
    """A step's loss, gradient norm or new state was not finite; that state was not saved."""


@dataclasses.dataclass(frozen=True)
class StepEnd:
    step: int  # steps done: the state's step
    state: Any
    stopping: bool  # every process has been asked to stop: this is the segment's last step
    last: bool  # the run's last step (`steps`)
    flush: Callable[[], None]  # read this step's metrics now


class Hook:
    def before_step(self, step: int) -> None:
        pass

    def on_metrics(self, step: int, metrics: dict) -> None:
        pass

    def after_step(self, end: StepEnd) -> None:
        pass

    def close(self) -> None:
        pass


class Report(Hook):
    """Each step's record: checked finite, kept in `history`, written to metrics.jsonl (and
    TensorBoard) by `writer`, shown on the progress bar and, every `log_period` steps (and the
    segment's first and the run's last), as MaxText's line. `last_good()` says which checkpoint
    a non-finite step leaves the user with."""

    def __init__(self, *, log_period: int, steps: int, start: int, writer, bar, info: Callable[[str], None],
                 throughput: metrics_lib.Throughput, leaf_paths, last_good: Callable[[], str]):
        self.log_period, self.steps, self.start = log_period, steps, start
        self.writer, self.bar, self.info = writer, bar, info
        self.throughput, self.leaf_paths, self.last_good = throughput, leaf_paths, last_good
        self.history: list[dict[str, Any]] = []
        self.last_time = time.perf_counter()

    def on_metrics(self, step: int, metrics: dict) -> None:
        raw = jax.device_get(metrics)
        now = time.perf_counter()
        record = metrics_lib.step_record(step, now - self.last_time, raw, self.throughput)
        self.last_time = now
        if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
            raise NonFiniteError(
                f"Non-finite loss at step {step} (loss={record['loss']}, grad_norm={record['grad_norm']}); "
                f"stopping without saving. {self.last_good()}"
            )
        bad = integrity.first_non_finite(self.leaf_paths, raw["finite"])
        if bad is not None:
            raise NonFiniteError(
                f"Non-finite state after step {step}: {bad} is not finite (the step's loss "
                f"{record['loss']:.4f} was); stopping without saving it. {self.last_good()}"
            )
        self.history.append(record)
        if self.writer:
            self.writer.write(record)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.3f}")
        if step % self.log_period == 0 or step == self.steps or step == self.start + 1:
            self.info(metrics_lib.maxtext_line(record))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer:
            self.writer.close()


class Profile(Hook):
    """An XLA trace (`profiler=xplane`) of steps `first` .. `first + count - 1`, into `directory`."""

    def __init__(self, directory: str, first: int, count: int):
        self.directory, self.first, self.count = directory, first, count
        self.tracing = False

    def before_step(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(os.path.join(self.directory, "profile"))
            self.tracing = True

    def after_step(self, end: StepEnd) -> None:
        if self.tracing and end.step >= self.first + self.count:
            jax.block_until_ready(end.state)
            self.close()

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


class Checkpoint(Hook):
    """`save(step, state)` every `period` steps, at the run's last step and at a stop, once the
    step's metrics have shown it finite."""

    def __init__(self, period: int, save: Callable[[int, Any], None]):
        self.period, self.save = period, save

    def after_step(self, end: StepEnd) -> None:
        if end.step % self.period == 0 or end.last or end.stopping:
            end.flush()  # never save a state whose step went non-finite
            self.save(end.step, end.state)


class Evaluate(Hook):
    """`evaluate(step, state)` every `interval` steps, except at the run's last step (the final
    evaluation follows the loop) and at a stop."""

    def __init__(self, interval: int, evaluate: Callable[..., float]):
        self.interval, self.evaluate = interval, evaluate

    def after_step(self, end: StepEnd) -> None:
        if end.step % self.interval == 0 and not end.last and not end.stopping:
            self.evaluate(end.step, end.state)
