"""Evaluating a training state: the held-out loss through the forward pass(es) that
`eval_quantization` names, and the quantization statistics beside it.

`eval_quantization=train` evaluates through the forward pass the run trains with at that point
(BF16 once the `quantization_end_step` tail has begun), `bf16` through BF16 dots with the same
weights, `both` through each (a run that is not quantizing has one forward pass and evaluates it
once). The held-out batches are loaded on the first evaluation and reused every time.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np

from nvfp4_jax.config import Config
from nvfp4_jax.quant import health


def quantizes_after(cfg: Config, step: int) -> bool:
    """Whether the step after `step` runs the quantized GEMMs (not yet the BF16 tail)."""
    end = cfg.train.quantization_end_step
    return end < 0 or step < end


class Evaluation:
    """The run's evaluations. `run` provides the eval steps (`eval_step`, the lazily built
    `bf16_eval_step`, `quant_stats_step`) and `startup.quantizes_anything` (an `assembly.Run`);
    `load_batches()` returns the held-out batches, placed on the mesh; `writer` (or None on a
    process that does not write) receives each evaluation's record."""

    def __init__(self, cfg: Config, run, load_batches: Callable[[], list], writer, info: Callable[[str], None]):
        self.cfg, self.run, self.writer, self.info = cfg, run, writer, info
        self._load_batches = load_batches
        self.batches: list = []
        self.quantizes_anything = run.startup.quantizes_anything
        self.stats_step = run.quant_stats_step if cfg.train.quant_stats else None
        self.last: dict[str, Any] = {}  # the newest evaluation's record

    def __call__(self, step: int, state, *, log: bool = True) -> float:
        """The validation loss of `state` (the state after `step`): `eval_loss` and/or
        `eval_loss_bf16`, as `eval_quantization` asks. Returns the first. `log=False`: the
        file already holds this evaluation."""
        if not self.batches:
            self.batches.extend(self._load_batches())

        def loss_of(eval_step) -> float:
            return float(np.mean(jax.device_get([eval_step(state, b) for b in self.batches])))

        mode = self.cfg.train.eval_quantization
        trains_quantized = self.quantizes_anything and quantizes_after(self.cfg, step)
        record: dict[str, Any] = {"step": step}
        if mode in ("train", "both"):
            record["eval_loss"] = loss_of(self.run.eval_step if trains_quantized else self.run.bf16_eval_step)
        if mode in ("bf16", "both"):
            # A run that is not quantizing now has one forward pass: evaluate it once.
            record["eval_loss_bf16"] = (record["eval_loss"] if "eval_loss" in record and not trains_quantized
                                        else loss_of(self.run.bf16_eval_step))
        value = record.get("eval_loss", record.get("eval_loss_bf16"))
        perplexity = math.exp(min(value, 700))
        record["eval_perplexity"] = perplexity
        if self.writer and log:
            self.writer.write(record)
        extra = f", bf16 forward: {record['eval_loss_bf16']:.3f}" if mode == "both" else ""
        self.info(f"eval at step {step}{' (bf16 forward)' if mode == 'bf16' else ''}: "
                  f"loss: {value:.3f}, perplexity: {perplexity:.3f}{extra}")
        # Measured while the run still quantizes (the BF16 tail has nothing to measure).
        if self.stats_step is not None and quantizes_after(self.cfg, step):
            stats = health.flatten(jax.device_get(self.stats_step(state, self.batches[0])))
            if self.writer and log:
                self.writer.write({"step": step, "quant_stats": stats})
        self.last = record
        return value
