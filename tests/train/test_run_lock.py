"""The run lock: one live process per run directory; stale locks are taken over, others named."""

import json
import os
import socket
import subprocess
import sys

import pytest

from nvfp4_jax.train import run_lock


@pytest.fixture
def live_pid():
    """The pid of a process that stays alive until the test ends (it waits on its stdin)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc.pid
    proc.stdin.close()
    proc.wait()


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid no longer exists
    return proc.pid


def _write_lock(run_dir, host, pid):
    with open(os.path.join(run_dir, run_lock.LOCK_NAME), "w") as f:
        json.dump({"host": host, "pid": pid, "since": "2026-01-01 00:00:00"}, f)


def test_lock_holds_host_and_pid_and_is_released(tmp_path):
    with run_lock.hold(str(tmp_path)) as path:
        holder = json.load(open(path))
        assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
        # A second acquisition, even by this process, is refused while the first holds it.
        with pytest.raises(run_lock.RunLockedError, match=rf"pid {os.getpid()} on host"):
            run_lock.acquire(str(tmp_path))
    assert not os.path.exists(path)


def test_lock_is_released_on_an_exception(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with run_lock.hold(str(tmp_path)):
            1 / 0
    assert os.listdir(tmp_path) == []


def test_a_live_holder_is_named(tmp_path, live_pid):
    _write_lock(tmp_path, socket.gethostname(), live_pid)
    with pytest.raises(run_lock.RunLockedError) as err:
        run_lock.acquire(str(tmp_path))
    message = str(err.value)
    assert f"pid {live_pid} on host {socket.gethostname()}" in message and "run_name" in message
    assert json.load(open(tmp_path / run_lock.LOCK_NAME))["pid"] == live_pid  # untouched


def test_a_stale_lock_on_this_host_is_taken_over_with_a_warning(tmp_path, dead_pid):
    _write_lock(tmp_path, socket.gethostname(), dead_pid)
    warnings = []
    path = run_lock.acquire(str(tmp_path), warn=warnings.append)
    assert json.load(open(path))["pid"] == os.getpid()
    assert len(warnings) == 1 and f"stale lock" in warnings[0] and f"pid {dead_pid}" in warnings[0]
    run_lock.release(path)


def test_a_lock_of_another_host_is_not_taken_over(tmp_path, dead_pid):
    _write_lock(tmp_path, "some-other-host", dead_pid)
    with pytest.raises(run_lock.RunLockedError, match=r"on host some-other-host.*another host"):
        run_lock.acquire(str(tmp_path))


def test_release_leaves_a_lock_that_another_process_holds(tmp_path, live_pid):
    _write_lock(tmp_path, socket.gethostname(), live_pid)
    run_lock.release(str(tmp_path / run_lock.LOCK_NAME))
    assert os.path.exists(tmp_path / run_lock.LOCK_NAME)


def test_an_unreadable_lock_is_not_taken_over(tmp_path):
    (tmp_path / run_lock.LOCK_NAME).write_text("")
    with pytest.raises(run_lock.RunLockedError, match="cannot be read"):
        run_lock.acquire(str(tmp_path))
