"""A run directory and its files; the one place that knows their names and formats.

    <base_output_directory>/<run_name>/
      run.lock        the live process that owns the run (`run_lock`), absent when none does
      config.json     the resolved config of the latest segment (written once a resume is accepted)
      metrics.jsonl   one JSON object per line, appended as the run goes, each tagged `segment`
      summary.json    written at the end of every segment; the run is finished when it records
                      the final evaluation (`is_finished`)
      checkpoints/    orbax step folders (`checkpoint`)
      rejected_checkpoints/   damaged checkpoints set aside, never deleted

Readers are tolerant where a kill explains the damage (a summary or a last metrics line cut
short) and loud where it does not (a line in the middle of metrics.jsonl that is not a record is
reported with its line number). Nothing here imports jax: the lab reads runs without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Callable, Iterator, TextIO

from nvfp4_jax.config import Config, ConfigError, from_dict, save_json
from nvfp4_jax.train import run_lock
from nvfp4_jax.train.run_lock import RunLockedError  # noqa: F401  (re-exported: callers catch it here)

CONFIG, METRICS, SUMMARY, CHECKPOINTS, REJECTED = (
    "config.json", "metrics.jsonl", "summary.json", "checkpoints", "rejected_checkpoints")


class MetricsError(ValueError):
    """metrics.jsonl holds a line that is not a record, and not only as its last line."""


class WriteError(RuntimeError):
    """A file of the run directory could not be written (disk full, permissions): one line naming
    the file and the system's reason. What was on disk before stays intact."""


def _cannot_write(file: str, exc: OSError) -> WriteError:
    return WriteError(f"Cannot write {file}: {exc.strerror or exc}")


def path(cfg: Config) -> str:
    """The run directory of `cfg`: base_output_directory/run_name (a name made from the model
    and quantization when run_name is empty)."""
    name = cfg.train.run_name or f"{cfg.model.model_name}-{cfg.model.quantization or 'bf16'}"
    return os.path.join(cfg.train.base_output_directory, name)


def create(cfg: Config) -> str:
    """Creates (or reuses) the run directory of `cfg`; ConfigError when it cannot be written."""
    run_dir = path(cfg)
    base = cfg.train.base_output_directory
    if os.path.exists(base) and not os.path.isdir(base):
        raise ConfigError(f"base_output_directory={base!r} is a file, not a directory.")
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"Cannot create the run directory {run_dir!r}: {exc.strerror}.") from None
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"The run directory {run_dir!r} is not writable.")
    return run_dir


def lock(run_dir: str, *, warn: Callable[[str], None] = print):
    """`with lock(run_dir):` one process per run (RunLockedError when a live one holds it)."""
    return run_lock.hold(run_dir, warn=warn)


def checkpoints(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def rejected(run_dir: str) -> str:
    return os.path.join(run_dir, REJECTED)


def _read_json(file: str) -> Any:
    try:
        with open(file) as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except json.JSONDecodeError:
        return None  # written half-way when the run was killed


def _write_json(file: str, value: Any) -> None:
    # Written aside and renamed, so a kill leaves the old file or the new one, never half of one.
    tmp = f"{file}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=2)
        os.replace(tmp, file)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise _cannot_write(file, exc) from exc


# --- config.json --------------------------------------------------------------------------------


def write_config(run_dir: str, cfg: Config) -> None:
    file = os.path.join(run_dir, CONFIG)
    try:
        save_json(cfg, file)
    except OSError as exc:
        raise _cannot_write(file, exc) from exc


def read_config(run_dir: str) -> dict | None:
    """The saved config in `to_dict` form; None when absent or unreadable."""
    saved = _read_json(os.path.join(run_dir, CONFIG))
    return saved if isinstance(saved, dict) else None


def read_run_config(run_dir: str) -> Config:
    """The run's saved config; ConfigError (one line) when `run_dir` has no config.json."""
    path = os.path.join(run_dir, CONFIG)
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir!r} is not a run directory: it has no {CONFIG}.")
    with open(path) as f:
        return from_dict(json.load(f))


# --- summary.json -------------------------------------------------------------------------------


def write_summary(run_dir: str, summary: dict[str, Any]) -> None:
    _write_json(os.path.join(run_dir, SUMMARY), summary)


def read_summary(run_dir: str) -> dict[str, Any] | None:
    summary = _read_json(os.path.join(run_dir, SUMMARY))
    return summary if isinstance(summary, dict) else None


def is_finished(run_dir: str, steps: int | None = None) -> bool:
    """Whether the run in `run_dir` is finished: its summary records the final evaluation at its
    last step (or later, after a resume that lowered `steps`), of `steps` when given. A run
    stopped by a signal, or whose final evaluation was lost, is not; resuming it runs what is
    missing."""
    summary = read_summary(run_dir)
    return (
        summary is not None
        and summary.get("final_eval_loss") is not None
        and summary.get("stopped_by") is None
        and isinstance(summary.get("steps"), int)
        and summary.get("step_reached", summary["steps"]) >= summary["steps"]
        and (steps is None or summary.get("steps") == steps)
    )


# --- metrics.jsonl ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Scan:
    records: list[dict[str, Any]]
    bad_lines: list[int]  # 1-based numbers of non-empty lines that are not a JSON object
    torn_last: bool  # the last line is cut short (a kill mid-write): expected, not an error


def _scan(file: str) -> _Scan:
    records, bad = [], []
    try:
        with open(file) as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return _Scan([], [], False)
    complete = lines[-1] == ""  # every record ends with a newline; a torn one does not
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    for number, line in numbered:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            bad.append(number)
    torn_last = bool(bad) and bad[-1] == numbered[-1][0] and not complete
    if torn_last:
        bad = bad[:-1]
    return _Scan(records, bad, torn_last)


def _bad_lines_text(file: str, bad: list[int]) -> str:
    shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
    return f"{file} line{'s' if len(bad) > 1 else ''} {shown} {'are' if len(bad) > 1 else 'is'} not a JSON record"


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of `run_dir`'s metrics.jsonl, in file order ([] when there is none).

    A last line cut short (a kill mid-write) is skipped; any other line that is not a JSON object
    raises MetricsError with its line number, so that no record is silently lost or miscounted.
    """
    file = os.path.join(run_dir, METRICS)
    scan = _scan(file)
    if scan.bad_lines:
        raise MetricsError(_bad_lines_text(file, scan.bad_lines) + " (edited or damaged by hand?).")
    return scan.records


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and (
        a == b or abs(a - b) <= 1e-6 * max(abs(a), abs(b)))


def finished_run_problems(run_dir: str) -> list[str]:
    """What is wrong with the files of a run whose summary says it is finished (`is_finished`),
    one phrase each ([] when nothing is): metrics.jsonl missing, a line in it that is not a
    record or was cut short, a step from 1 to the final one without its training-loss record,
    no final evaluation record, or a summary whose final losses are not the file's."""
    summary = read_summary(run_dir) or {}
    final = summary.get("step_reached", summary.get("steps"))
    file = os.path.join(run_dir, METRICS)
    if not os.path.isfile(file):
        return [f"{METRICS} is missing"]
    scan = _scan(file)
    problems = []
    if scan.bad_lines:
        problems.append(_bad_lines_text(file, scan.bad_lines))
    if scan.torn_last:
        problems.append(f"the last line of {METRICS} is cut short")
    losses = dict(iter_steps(scan.records, "loss"))
    missing = [s for s in range(1, final + 1) if s not in losses] if isinstance(final, int) else []
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        problems.append(f"{METRICS} has no training-loss record of step{'s' if len(missing) > 1 else ''} {shown} "
                        f"({len(missing)} of the {final} steps)")
    evals = [r for r in scan.records if r.get("step") == final and ("eval_loss" in r or "eval_loss_bf16" in r)]
    if not evals:
        problems.append(f"{METRICS} has no final evaluation record (step {final})")
    else:
        last = evals[-1]
        value = last.get("eval_loss", last.get("eval_loss_bf16"))
        if not _same(summary.get("final_eval_loss"), value):
            problems.append(f"the summary's final_eval_loss {summary.get('final_eval_loss')!r} is not "
                            f"{METRICS}'s {value!r} at step {final}")
        bf16 = summary.get("final_eval_loss_bf16")
        if bf16 is not None and not _same(bf16, last.get("eval_loss_bf16")):
            problems.append(f"the summary's final_eval_loss_bf16 {bf16!r} is not "
                            f"{METRICS}'s {last.get('eval_loss_bf16')!r} at step {final}")
    if summary.get("final_train_loss") is not None and final in losses \
            and not _same(summary["final_train_loss"], losses[final]):
        problems.append(f"the summary's final_train_loss {summary['final_train_loss']!r} is not "
                        f"{METRICS}'s {losses[final]!r} at step {final}")
    return problems


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl, each tagged with this segment's id.

    A run is made of segments: the first start, then each resume. Opening the file for a segment
    that starts at step `start` first drops the records of later steps: an earlier segment logged
    them after its last checkpoint, and this one will log them again (bit-identically), so every
    step appears once. `notes` says what was dropped and why, one line each, for the console.
    """

    def __init__(self, run_dir: str, *, start: int = 0):
        file = os.path.join(run_dir, METRICS)
        scan = _scan(file)
        kept = [r for r in scan.records if int(r.get("step", 0)) <= start]
        self.segment: int = 1 + max((int(r.get("segment", 0)) for r in scan.records), default=-1)
        self.dropped: int = len(scan.records) - len(kept)  # records of steps after `start`
        self.notes: list[str] = []
        if self.dropped:
            self.notes.append(f"metrics.jsonl: dropped {self.dropped} records logged after step {start} by an "
                              "earlier segment (this one logs those steps again).")
        if scan.torn_last:
            self.notes.append("metrics.jsonl: dropped its last line, cut short when an earlier segment was killed.")
        if scan.bad_lines:
            self.notes.append(f"warning: {_bad_lines_text(file, scan.bad_lines)}; dropped "
                              f"{'them' if len(scan.bad_lines) > 1 else 'it'}.")
        self.file = file
        try:
            if self.dropped or scan.torn_last or scan.bad_lines:
                tmp = f"{file}.tmp"  # rewritten aside: a failure leaves the old file as it was
                with open(tmp, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in kept)
                os.replace(tmp, file)
            self._file: TextIO = open(file, "a")
        except OSError as exc:
            raise _cannot_write(file, exc) from exc
        self._logged = {(r.get("step"), key) for r in kept for key in r}

    def has(self, step: int, key: str) -> bool:
        """Whether a record of `step` holding `key` is in the file (kept, or written since)."""
        return (step, key) in self._logged

    def write(self, record: dict[str, Any]) -> None:
        """Appends `record` and flushes it; WriteError when the disk refuses it (the line may be
        cut short: the next segment's reader drops a torn last line)."""
        try:
            self._file.write(json.dumps({**record, "segment": self.segment}) + "\n")
            self._file.flush()
        except OSError as exc:
            raise _cannot_write(self.file, exc) from exc
        self._logged.update((record.get("step"), key) for key in record)

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # the bytes it could not flush were reported by write()


def iter_steps(records: list[dict[str, Any]], key: str) -> Iterator[tuple[int, Any]]:
    """(step, record[key]) of each record holding `key` and an integer step, in file order."""
    for record in records:
        if key in record and isinstance(record.get("step"), int):
            yield record["step"], record[key]
