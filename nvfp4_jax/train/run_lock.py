"""One process per run directory: a lock file holding the owner's host and pid.

The lock is created with `O_CREAT | O_EXCL`, which is atomic on local and network file systems,
so of two processes starting the same run exactly one gets it. A lock whose process is gone (on
this host: its pid no longer exists) is stale and is taken over with a warning; a lock held by
another host cannot be checked from here, so it is reported with the holder's name.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from typing import Callable, Iterator

LOCK_NAME = "run.lock"


class RunLockedError(RuntimeError):
    """Another live process holds the run directory."""


def _holder_text(holder: dict) -> str:
    since = f", since {holder['since']}" if holder.get("since") else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{since}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else None
    except (OSError, ValueError):
        return None


def _create(path: str, me: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    return True


def acquire(run_dir: str, *, warn: Callable[[str], None] = print) -> str:
    """Takes the lock of `run_dir`; returns its path. Raises RunLockedError when it is held."""
    path = os.path.join(run_dir, LOCK_NAME)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    if _create(path, me):
        return path
    holder = _read(path)
    if holder is None:
        raise RunLockedError(
            f"{run_dir} is locked by {path}, which cannot be read (another process may be creating "
            "it). If no run is using this directory, delete that file."
        )
    same_host = holder.get("host") == me["host"]
    if same_host and isinstance(holder.get("pid"), int) and not pid_alive(holder["pid"]):
        warn(f"warning: taking over the stale lock of {run_dir} left by {_holder_text(holder)}, "
             "which is no longer running.")
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        if _create(path, me):
            return path
        holder = _read(path) or holder  # another process won the takeover
    where = "" if same_host else " (another host: this one cannot tell whether it still runs)"
    raise RunLockedError(
        f"{run_dir} is in use by {_holder_text(holder)}{where}. Wait for that run to finish, or use "
        f"another run_name=...; if that process is gone, delete {path}."
    )


def release(path: str) -> None:
    """Removes the lock if this process still holds it."""
    holder = _read(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def hold(run_dir: str, *, warn: Callable[[str], None] = print) -> Iterator[str]:
    """`with hold(run_dir):` holds the lock for the block, releasing it on any exit."""
    path = acquire(run_dir, warn=warn)
    try:
        yield path
    finally:
        release(path)
