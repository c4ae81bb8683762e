"""Helpers for the training tests: damaging a checkpoint, and running the training command as a
real process (signals, kills, locks).

Every such run uses `CLI_ARGS` on one CPU device, so their losses compare bit for bit with the
uninterrupted reference run (`reference_losses`). An in-process run on the test session's eight
virtual devices is not comparable to those at the last bit, so the reference is a process too.
"""

import os
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nvfp4_jax.train.run_dir import read_metrics  # noqa: F401  (the tests' reader too)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLI_ARGS = [
    "model_name=tiny", "base_num_decoder_layers=1", "max_target_length=32", "per_device_batch_size=4",
    "quantization=te_nvfp4", "steps=6", "log_period=1", "eval_steps=1", "eval_interval=1000",
    "checkpoint_period=2", "run_name=run",
]

# The training command with two hooks, so that a test knows where the process is:
# - HOLD_SAVE_AT: when the step orbax commits (renames its temporary folder) is this one (or any
#   step, for "any"), print "INSIDE_SAVE <step> <temporary folder>" and wait there, inside the
#   save, with the arrays written but not committed, until a signal ends the process.
# - FAIL_SAVE_AT: the commit of this step fails as on a full disk (OSError ENOSPC).
# - HOLD_BATCH_AT: before loading the training batch of this step index, print
#   "WAITING_AT_BATCH <step>" and wait for a line on stdin (`Training.release`).
_HOOKED_MAIN = textwrap.dedent(
    """
    import os, sys, time
    from orbax.checkpoint._src.path import atomicity
    import nvfp4_jax.data as data

    hold_batch_at = os.environ.get("HOLD_BATCH_AT", "")
    load_batch = data.TokenBatches.batch

    def batch(self, step, *args, **kwargs):
        if self.split == "train" and str(step) == hold_batch_at:
            print(f"WAITING_AT_BATCH {step}", flush=True)
            sys.stdin.readline()
        return load_batch(self, step, *args, **kwargs)

    data.TokenBatches.batch = batch

    hold_at = os.environ.get("HOLD_SAVE_AT", "")
    fail_at = os.environ.get("FAIL_SAVE_AT", "")
    commit = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        final = self.get_final()
        if final.name == fail_at:
            raise OSError(28, "No space left on device", str(self.get()))
        if final.name.isdigit() and hold_at in ("any", final.name):
            print(f"INSIDE_SAVE {final.name} {self.get()}", flush=True)
            while True:
                time.sleep(3600)
        return await commit(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize
    from nvfp4_jax.train.__main__ import main
    sys.exit(main(sys.argv[1:]))
    """
)


# Set by conftest.py for the session: the processes share one persistent compilation cache, so
# only the first compiles (a cached executable computes the same bits).
COMPILATION_CACHE = {"dir": None}


def cli_env(**extra):
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1", **extra)
    if COMPILATION_CACHE["dir"]:
        env.update(JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE["dir"], JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop("NVFP4_JAX_DEBUG", None)
    return env


class Training:
    """A training process started with `CLI_ARGS` + extra args in `out_dir`."""

    def __init__(self, out_dir, *extra, hold_save_at=None, hold_batch_at=None, fail_save_at=None):
        self.run_dir = os.path.join(str(out_dir), "run")
        self.stderr_path = os.path.join(str(out_dir), f"stderr-{time.monotonic_ns()}.txt")
        hooks = {"HOLD_SAVE_AT": hold_save_at, "HOLD_BATCH_AT": hold_batch_at, "FAIL_SAVE_AT": fail_save_at}
        env = cli_env(**{k: str(v) for k, v in hooks.items() if v is not None})
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _HOOKED_MAIN, *CLI_ARGS, f"base_output_directory={out_dir}", *extra],
                env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
            )
        self.stdout: list[str] = []
        # A thread reads stdout line by line: select() on a buffered pipe misses lines that the
        # buffer already holds.
        self._lines: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    @property
    def stderr(self) -> str:
        with open(self.stderr_path) as f:
            return f.read()

    def wait_for(self, prefix: str, timeout: float = 300) -> str:
        """Reads stdout until a line starting with `prefix`; fails if the process ends first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                self._lines.put(None)  # keep the end-of-output mark for finish()
                break
            self.stdout.append(line)
            if line.startswith(prefix):
                return line
        pytest.fail(f"no line starting {prefix!r}; stdout: {self.stdout[-5:]}; stderr: {self.stderr[-2000:]}")

    def release(self) -> None:
        """Lets a process waiting at HOLD_BATCH_AT go on."""
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 300) -> int:
        """Waits for the process to end; returns its exit code (-N: ended by signal N)."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._reader.join(timeout=60)
        while (line := self._lines.get_nowait()) is not None:
            self.stdout.append(line)
        return self.proc.returncode


def train_losses(run_dir):
    """{step: loss}; fails if a step was logged twice."""
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"duplicate steps in metrics.jsonl: {steps}"
    return {r["step"]: r["loss"] for r in records}


def flip_bytes_in_largest_file(step_dir, count=4096):
    """XORs `count` bytes in the middle of the largest file under `step_dir`; size unchanged."""
    files = [os.path.join(root, f) for root, _, names in os.walk(step_dir) for f in names]
    path = max(files, key=os.path.getsize)
    size = os.path.getsize(path)
    count = min(count, size // 2)
    with open(path, "r+b") as f:
        f.seek((size - count) // 2)
        chunk = f.read(count)
        f.seek((size - count) // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    assert os.path.getsize(path) == size
    return path
