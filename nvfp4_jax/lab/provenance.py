"""Where a study's numbers come from: the commit (and whether the tree was dirty), the package
versions, the device. A results file without them cannot be regenerated."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from typing import Any

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", _ROOT, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> dict[str, Any]:
    """{"commit": full hash or None, "dirty": local changes to tracked files under nvfp4_jax/
    or recipes/ (what a run computes with), or None outside a git checkout}."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no", "--", "nvfp4_jax", "recipes") if head else None
    return {"commit": head, "dirty": None if head is None else bool(status)}


def versions() -> dict[str, str | None]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def device() -> dict[str, Any]:
    # the lab reads runs without jax; the device is asked only when recorded
    import jax

    devices = jax.devices()
    return {"backend": jax.default_backend(), "count": len(devices), "kind": devices[0].device_kind,
            "cpus": os.cpu_count(), "machine": platform.machine()}


def record() -> dict[str, Any]:
    """Everything above in one dict, as results.json stores it under `provenance`."""
    return {**commit(), "versions": versions(), "device": device()}
