"""Signals and concurrent processes, on real training processes (see _helpers.py)."""

import json
import os
import signal
import socket

import pytest

from _helpers import Training, read_metrics, train_losses

pytestmark = pytest.mark.slow


def test_sigterm_finishes_the_step_saves_and_resume_continues_exactly(tmp_path, reference_losses):
    # No periodic checkpoint; the process waits before loading the batch of its third step.
    stopped = Training(tmp_path, "checkpoint_period=100", hold_batch_at=2)
    stopped.wait_for("WAITING_AT_BATCH 2")
    stopped.proc.send_signal(signal.SIGTERM)  # mid-run: steps 1 and 2 done, 3 about to start
    stopped.release()
    assert stopped.finish() == 75, stopped.stderr[-3000:]
    assert "received SIGTERM: finishing the current step" in stopped.stderr
    summary = json.load(open(os.path.join(stopped.run_dir, "summary.json")))
    assert summary["stopped_by"] == "SIGTERM" and summary["step_reached"] == 3  # finished step 3, no more
    assert summary["final_eval_loss"] is None  # no evaluation on the way out
    assert "Stopped by SIGTERM after step 3 (saved checkpoint step 3)" in "\n".join(stopped.stdout)
    assert os.listdir(os.path.join(stopped.run_dir, "checkpoints")) == ["3"]
    assert sorted(train_losses(stopped.run_dir)) == [1, 2, 3]
    assert not os.path.exists(os.path.join(stopped.run_dir, "run.lock"))  # released

    resumed = Training(tmp_path, "checkpoint_period=100")
    assert resumed.finish() == 0, resumed.stderr[-3000:]
    assert "Resumed from checkpoint step 3 " in "\n".join(resumed.stdout)
    assert train_losses(resumed.run_dir) == reference_losses  # each step once, bit-identical
    segments = {r["step"]: r["segment"] for r in read_metrics(resumed.run_dir) if "loss" in r}
    assert segments == {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1}


def test_a_second_signal_exits_at_once(tmp_path):
    # Every save pauses inside itself, so the graceful stop cannot finish on its own.
    proc = Training(tmp_path, "checkpoint_period=100", hold_save_at="any", hold_batch_at=1)
    proc.wait_for("WAITING_AT_BATCH 1")
    proc.proc.send_signal(signal.SIGINT)
    proc.release()
    # Saving step 2 (not 6) shows the first signal was taken: the stop's save is under way.
    assert proc.wait_for("INSIDE_SAVE").split()[1] == "2"
    proc.proc.send_signal(signal.SIGINT)
    assert proc.finish(timeout=60) == -signal.SIGINT  # ended by the signal itself, not by the loop
    assert "received SIGINT" in proc.stderr
    assert not os.path.exists(os.path.join(proc.run_dir, "summary.json"))


def test_a_second_process_is_refused_while_the_first_runs(tmp_path, reference_losses):
    first = Training(tmp_path, hold_save_at=2)  # alive and holding the run, paused inside a save
    first.wait_for("INSIDE_SAVE 2")
    second = Training(tmp_path, "learning_rate=1e-3")  # even with other settings
    assert second.finish() == 2
    error = second.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and f"in use by pid {first.proc.pid} on host {socket.gethostname()}" in error
    assert "Traceback" not in second.stderr
    assert json.load(open(os.path.join(first.run_dir, "config.json")))["train"]["learning_rate"] == 3e-3

    first.proc.send_signal(signal.SIGKILL)
    first.finish()
    # The dead process's lock is stale: a new start takes it over and trains the run afresh
    # (nothing was committed), replacing the first start's log lines.
    third = Training(tmp_path)
    assert third.finish() == 0, third.stderr[-3000:]
    assert f"taking over the stale lock of {third.run_dir} left by pid {first.proc.pid}" in third.stderr
    assert train_losses(third.run_dir) == reference_losses
    assert {r["segment"] for r in read_metrics(third.run_dir)} == {1}
