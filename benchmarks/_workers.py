"""A benchmark worker in its own process (one per revision: two packages named nvfp4_jax cannot
share a process), driven one JSON line at a time so that the parent decides what is timed when."""

from __future__ import annotations

import json
import os
import subprocess
import sys


class Worker:
    """Runs `python script worker_args...` with PYTHONPATH=root on CPU; the worker prints one
    JSON line when ready and one per request line it reads."""

    def __init__(self, name: str, root: str, script: str, worker_args: list[str]):
        self.name = name
        env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
        self.proc = subprocess.Popen([sys.executable, script, *worker_args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self._read()  # ready

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited (code {self.proc.wait()})")
        return json.loads(line)

    def ask(self, request: str) -> dict:
        """Sends one request line; returns the worker's JSON answer."""
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
