"""A run's summary (summary.json and the closing block on the console): the whole run, not just
the segment that wrote it."""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any

from nvfp4_jax.config import Config
from nvfp4_jax.train import run_dir as run_dir_lib


@dataclasses.dataclass(frozen=True)
class SegmentOutcome:
    start: int  # the step the segment started from
    reached: int
    stopped_by: str | None  # the signal that stopped it, or None when it finished
    final_eval: float | None  # the final evaluation's loss (None when stopped)
    final_eval_bf16: float | None
    history: list  # this segment's step records
    segment: int | None  # metrics.jsonl's segment number (None on a process that does not write)
    last_checkpoint_step: int | None
    # model_type=vlm: the held-out questions' vqa_accuracy, vqa_chance, vqa_questions and both
    # per question type (train/vqa.py).
    vqa: dict[str, Any] | None = None


def summarize(cfg: Config, run_dir: str, outcome: SegmentOutcome, *, is_lead: bool) -> dict[str, Any]:
    """The summary; the lead process also writes it to summary.json. Earlier segments' records
    come from metrics.jsonl (which this segment's writer has just rewritten clean)."""
    records = run_dir_lib.read_metrics(run_dir) if is_lead else outcome.history
    train = sorted((r for r in records if "loss" in r), key=lambda r: r["step"])
    history = outcome.history
    steady = [r["tokens_per_device"] for r in history[1:]] or [r["tokens_per_device"] for r in history]
    summary = {
        "run_directory": os.path.abspath(run_dir),
        "steps": cfg.train.steps,
        "step_reached": outcome.reached,
        "stopped_by": outcome.stopped_by,
        "resumed_from_step": outcome.start or None,
        "segment": outcome.segment,
        "quantization": cfg.model.quantization or "bf16",
        "first_train_loss": train[0]["loss"] if train else None,
        "final_train_loss": train[-1]["loss"] if train else None,
        "eval_quantization": cfg.train.eval_quantization,
        # Through the forward pass eval_quantization names ("bf16": the BF16 one).
        "final_eval_loss": outcome.final_eval,
        "final_eval_loss_bf16": outcome.final_eval_bf16,
        "median_tokens_per_second_per_device": statistics.median(steady) if steady else None,
        "median_step_seconds": (statistics.median([r["seconds"] for r in history[1:]])
                                if len(history) > 1 else None),
        "eval_losses": sorted(run_dir_lib.iter_steps(records, "eval_loss")),
        "eval_losses_bf16": sorted(run_dir_lib.iter_steps(records, "eval_loss_bf16")),
        "last_checkpoint_step": outcome.last_checkpoint_step,
        **(outcome.vqa or {}),
    }
    if is_lead:
        run_dir_lib.write_summary(run_dir, summary)
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
        *([f"  held-out VQA accuracy: {fmt(summary['vqa_accuracy'])} (chance {fmt(summary['vqa_chance'])}, "
           f"{summary['vqa_questions']} questions)"] if "vqa_accuracy" in summary else []),
        f"  tokens/s/device (median): {fmt(summary['median_tokens_per_second_per_device'], '.1f')}",
        f"  run directory: {summary['run_directory']}",
        "=" * 72,
    ])
