"""Per-step metrics: MaxText's log line, a JSONL file, and a progress bar for humans."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, TextIO


@dataclass(frozen=True)
class Throughput:
    """What a step's time means for this run (MaxText's definitions)."""

    flops_per_step: float  # analytic model FLOPs of one optimizer step, all devices together
    tokens_per_device_per_step: float  # max_target_length * per_device_batch_size
    num_devices: int

    def tflops_per_device(self, seconds: float) -> float:
        return self.flops_per_step / self.num_devices / seconds / 1e12

    def tokens_per_device(self, seconds: float) -> float:
        return self.tokens_per_device_per_step / seconds


def step_record(step: int, seconds: float, raw: dict[str, float], throughput: Throughput) -> dict[str, Any]:
    loss = float(raw["loss"])
    return {
        "step": step,
        "seconds": seconds,
        "tflops_per_device": throughput.tflops_per_device(seconds),
        "tokens_per_device": throughput.tokens_per_device(seconds),
        "total_weights": float(raw["total_weights"]),
        "loss": loss,
        "lm_loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "grad_norm": float(raw["grad_norm"]),
    }


def maxtext_line(r: dict[str, Any]) -> str:
    return (
        f"completed step: {r['step']}, seconds: {r['seconds']:.3f}, "
        f"TFLOP/s/device: {r['tflops_per_device']:.3f}, "
        f"Tokens/s/device: {r['tokens_per_device']:.3f}, "
        f"total_weights: {int(r['total_weights'])}, loss: {r['loss']:.3f}, "
        f"lm_loss: {r['lm_loss']:.3f}, perplexity: {r['perplexity']:.3f}"
    )


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order; a torn last line (a kill mid-write) is skipped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


class MetricsWriter:
    """Appends one JSON object per line, each tagged with this run segment's id.

    A run is made of segments: the first start, then each resume. Opening the file for a segment
    that starts at step `start` first drops the records of later steps: an earlier segment logged
    them after its last checkpoint, and this one will log them again (bit-identically), so every
    step appears once. `dropped` says how many were dropped.
    """

    def __init__(self, path: str, *, start: int = 0):
        old = read_metrics(path)
        kept = [r for r in old if int(r.get("step", 0)) <= start]
        self.segment: int = 1 + max((int(r.get("segment", 0)) for r in old), default=-1)
        lines = 0
        if os.path.exists(path):
            with open(path) as f:
                lines = sum(1 for line in f if line.strip())
        self.dropped: int = lines - len(kept)  # including a torn line
        if self.dropped:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(tmp, path)
        self._file: TextIO = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({**record, "segment": self.segment}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def progress_bar(start: int, total: int, enabled: bool | None = None):
    """A tqdm bar when stderr is a terminal, else None (logs stay clean in CI and files)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(initial=start, total=total, unit="step", dynamic_ncols=True, leave=False)
