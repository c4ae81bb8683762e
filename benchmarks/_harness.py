"""What the train-step benchmarks share: one compiled train step, timed one call at a time.

The step is the trainer's own, from its builder (`nvfp4_jax.train.assembly.Run`: the state's
shardings, donated state, the start-up decisions); only the model (and so its dot_generals)
varies. Each case steps on one fixed synthetic batch, so data loading is
not timed.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
import time
from typing import Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh

from nvfp4_jax.config import Config
from nvfp4_jax.train import assembly
from nvfp4_jax.train.optimizer import make_optimizer


class StepCase:
    """The train step of `model` on `mesh`, its own state, and the step times it has recorded."""

    def __init__(self, cfg: Config, mesh: Mesh, model: nn.Module):
        # The trainer's own builder, with the benchmark's model (bench_step's stand-ins).
        run = assembly.Run(cfg, mesh, assembly.resolve_startup(cfg, mesh), make_optimizer(cfg.train), model=model)
        self.state = run.init_state()
        self.step = run.train_step
        self.batch = jax.device_put(run.dataset("train").batch(0), run.batch_sharding)
        self.times: list[float] = []
        self.first_step_s: float | None = None
        self.loss: float | None = None
        self.lower_s: float | None = None
        self.compile_s: float | None = None

    def compile(self) -> None:
        """Lowers and compiles the step ahead of time, timing each; `run` then uses the executable."""
        t0 = time.perf_counter()
        lowered = self.step.lower(self.state, self.batch)
        t1 = time.perf_counter()
        self.step = lowered.compile()
        self.lower_s, self.compile_s = t1 - t0, time.perf_counter() - t1

    def run(self, record: bool = True) -> None:
        """One step, waited for; its wall time is recorded when `record`."""
        t0 = time.perf_counter()
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        dt = time.perf_counter() - t0
        if self.first_step_s is None:
            self.first_step_s = dt
        if record:
            self.times.append(dt)
        self.loss = float(metrics["loss"])


def interleaved(cases: Sequence[StepCase], warmup: int, repeats: int) -> None:
    """`warmup` untimed steps of each case (the first compiles), then `repeats` timed rounds.

    Every round runs one step of each case, starting one case later than the round before, so
    load from other processes hits every case alike.
    """
    for _ in range(warmup):
        for case in cases:
            case.run(record=False)
    for r in range(repeats):
        k = r % len(cases)
        for case in list(cases[k:]) + list(cases[:k]):
            case.run()


def traced_ops(case: StepCase, steps: int) -> list[tuple[str, str, float]]:
    """(hlo_op, device_ordinal, microseconds) of every op XLA:CPU ran in `steps` more steps.

    From `jax.profiler.trace(create_perfetto_trace=True)`: the CPU runtime writes one event per
    executed HLO op, with `hlo_op` and `device_ordinal` in its args. Ops on one device may run
    concurrently, so their sum can exceed the wall time. Raises RuntimeError when the trace has
    no such events (another backend or jax version), rather than returning made-up numbers.
    """
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(steps):
                case.run(record=False)
        paths = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
        if not paths:
            raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {tmp}")
        with gzip.open(paths[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ops = [
        (e["args"]["hlo_op"], str(e["args"].get("device_ordinal")), float(e.get("dur", 0.0)))
        for e in events
        if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})
    ]
    if not ops:
        raise RuntimeError("the profiler trace holds no per-op events (no 'hlo_op' args)")
    return ops


def hlo_op_names(case: StepCase) -> dict[str, str]:
    """Compiled HLO instruction name -> the JAX op_name in its metadata (its source path)."""
    text = case.step.lower(case.state, case.batch).compile().as_text()
    pattern = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{op_name="([^"]+)"')
    return {m.group(1): m.group(2) for m in map(pattern.match, text.splitlines()) if m}


def in_fresh_process(script: str, args: Sequence[str], timeout: float | None = None) -> dict:
    """Runs `python script *args` in a new process and returns the JSON object its last line holds.

    A fresh process shares no jit cache and no device-memory high-water mark with other cases.
    Raises RuntimeError with the child's last output lines when it fails or times out.
    """
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(args)}: timed out after {timeout:.0f} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(args)} failed ({done.returncode}):\n{tail}")
    return json.loads(lines[-1])
