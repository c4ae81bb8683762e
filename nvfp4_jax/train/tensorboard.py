"""TensorBoard scalars of the step metrics, in `<run dir>/tensorboard/` (tensorboardX, lazily).

The same records as `metrics.jsonl`, under MaxText's tag names, keyed by step. A resume that
starts at step `start` first removes the events of later steps from the existing event files
(an earlier segment logged them after its last checkpoint; this one logs them again), each file
rewritten whole and renamed over the old one, so any reader sees every step once.
"""

from __future__ import annotations

import os
import struct
from typing import Any, Callable, Iterator

TENSORBOARD_DIR = "tensorboard"
# Step record key -> MaxText's TensorBoard tag.
STEP_TAGS = {
    "loss": "learning/loss",
    "grad_norm": "learning/grad_norm",
    "total_weights": "learning/total_weights",
    "learning_rate": "learning/current_learning_rate",
    "seconds": "perf/step_time_seconds",
    "tflops_per_device": "perf/per_device_tflops_per_sec",
    "tokens_per_device": "perf/per_device_tokens_per_sec",
}
EVAL_TAGS = {"eval_loss": "eval/avg_loss", "eval_perplexity": "eval/perplexity"}
MISSING = "tensorboardX is not installed (pip install 'nvfp4_jax[tensorboard]')"


def _masked_crc(data: bytes) -> int:
    # optional dependency (tensorboardX)
    from tensorboardX.crc32c import crc32c

    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _record_at(data: bytes, pos: int) -> int | None:
    """The end of the TFRecord at `pos` when its length and payload CRCs hold; else None."""
    if pos + 12 > len(data):
        return None
    header = data[pos:pos + 8]
    if struct.unpack("<I", data[pos + 8:pos + 12])[0] != _masked_crc(header):
        return None
    (length,) = struct.unpack("<Q", header)
    end = pos + 12 + length + 4
    if end > len(data) or struct.unpack("<I", data[end - 4:end])[0] != _masked_crc(data[pos + 12:end - 4]):
        return None
    return end


def _records(path: str, damage: list[tuple[int, int]] | None = None) -> Iterator[tuple[bytes, bytes]]:
    """(whole record, payload) of each intact TFRecord in an event file, its CRCs checked: damage
    in the middle (or a torn tail) is skipped by scanning forward to the next intact record, so
    every valid record before and after it is kept. Each skipped span is appended to `damage` as
    `(offset, length)` in bytes."""
    with open(path, "rb") as f:
        data = f.read()
    pos, bad_from = 0, None
    while pos < len(data):
        end = _record_at(data, pos)
        if end is None:
            bad_from = pos if bad_from is None else bad_from
            pos += 1
            continue
        if bad_from is not None and damage is not None:
            damage.append((bad_from, pos - bad_from))
        bad_from = None
        yield data[pos:end], data[pos + 12:end - 4]
        pos = end
    if bad_from is not None and damage is not None:
        damage.append((bad_from, len(data) - bad_from))


def event_files(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if "tfevents" in n)


def drop_after(directory: str, start: int, damaged: list[str] | None = None) -> int:
    """Removes the events of steps > `start` (and damaged bytes: a torn last record, or damage
    in the middle, each intact record around it kept); returns how many scalar events were
    removed. Each file that had damaged bytes is described in one phrase appended to `damaged`."""
    # optional dependency (tensorboardX)
    from tensorboardX.proto import event_pb2

    dropped = 0
    for path in event_files(directory):
        damage: list[tuple[int, int]] = []
        records = list(_records(path, damage))
        if damage and damaged is not None:
            spans = ", ".join(f"{length} bytes at offset {offset}" for offset, length in damage)
            damaged.append(f"{os.path.basename(path)}: {spans}")
        kept = [record for record, payload in records
                if not _is_later(event_pb2.Event.FromString(payload), start)]
        if len(kept) == len(records) and sum(map(len, kept)) == os.path.getsize(path):
            continue
        tmp = os.path.join(directory, ".rewrite.tmp")  # no "tfevents": no reader picks it up
        with open(tmp, "wb") as f:
            f.writelines(kept)
        os.replace(tmp, path)
        dropped += len(records) - len(kept)
    return dropped


def _is_later(event, start: int) -> bool:
    return event.HasField("summary") and event.step > start


class TensorBoardWriter:
    """Writes each metrics record as scalars at its step (flushed at once: a kill loses none)."""

    def __init__(self, directory: str, *, start: int, learning_rate: Callable[[int], float]):
        # optional dependency (tensorboardX)
        from tensorboardX import SummaryWriter

        os.makedirs(directory, exist_ok=True)
        self.damaged: list[str] = []  # one phrase per event file that had damaged bytes
        self.dropped = drop_after(directory, start, self.damaged)
        self._learning_rate = learning_rate
        # Event files are named by the second they were opened in: a numbered suffix keeps a
        # quick restart from truncating the earlier segment's file.
        suffix = f".{len(event_files(directory))}"
        self._writer = SummaryWriter(logdir=directory, flush_secs=10**6, filename_suffix=suffix)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        scalars: dict[str, float] = {}
        if "loss" in record:
            # Step n's update used the schedule at count n - 1 (optax counts updates from 0).
            record = {**record, "learning_rate": self._learning_rate(step - 1)}
            scalars.update({tag: record[key] for key, tag in STEP_TAGS.items()})
        scalars.update({tag: record[key] for key, tag in EVAL_TAGS.items() if key in record})
        for projection, operands in record.get("quant_stats", {}).items():
            for operand, stats in operands.items():
                scalars.update({f"quant_stats/{projection}/{operand}/{s}": v for s, v in stats.items()})
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Both:
    """metrics.jsonl and TensorBoard behind the MetricsWriter interface (the rest of which,
    `has`, `segment`, `notes`, ..., is the MetricsWriter's)."""

    def __init__(self, jsonl, board: TensorBoardWriter):
        self._jsonl, self._board = jsonl, board

    def __getattr__(self, name: str):
        return getattr(self._jsonl, name)

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(record)
        self._board.write(record)

    def close(self) -> None:
        self._jsonl.close()
        self._board.close()


def with_tensorboard(jsonl, cfg, run_dir: str, start: int, warn: Callable[[str], None]):
    """`jsonl` (a MetricsWriter) plus TensorBoard when `enable_tensorboard`; without tensorboardX
    installed, one warning and `jsonl` alone (the run goes on)."""
    if not cfg.train.enable_tensorboard:
        return jsonl
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        warn(f"warning: {MISSING}: no TensorBoard events for this run; metrics.jsonl has them all "
             "(enable_tensorboard=false silences this).")
        return jsonl
    # optimizer imports jax; the event-file readers here do not need it
    from nvfp4_jax.train.optimizer import learning_rate_schedule

    schedule = learning_rate_schedule(cfg.train)
    board = TensorBoardWriter(os.path.join(run_dir, TENSORBOARD_DIR), start=start,
                              learning_rate=lambda count: float(schedule(count)))
    if board.damaged:
        warn(f"note: TensorBoard events: skipped damaged bytes ({'; '.join(board.damaged)}); every "
             "intact record before and after them is kept.")
    return _Both(jsonl, board)
