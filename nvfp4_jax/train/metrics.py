"""Per-step metrics: MaxText's log line and a progress bar for humans (the file they go to,
metrics.jsonl, is `run_dir`'s)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm


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


def progress_bar(start: int, total: int, enabled: bool | None = None):
    """A tqdm bar when stderr is a terminal, else None (logs stay clean in CI and files)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    return tqdm(initial=start, total=total, unit="step", dynamic_ncols=True, leave=False)
