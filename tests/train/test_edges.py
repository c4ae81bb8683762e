"""The run at its edges: a stop in the last step, output paths that are not what they
should be, a save that fails, a second signal while the main thread is busy in C, and the
metrics file's torn lines. In-process tests first (fast); the real-process ones are `slow`."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import orbax.checkpoint as ocp
import pytest

from _helpers import REPO, Training, cli_env
from nvfp4_jax import data as data_lib
from nvfp4_jax.config import ConfigError, load_config
from nvfp4_jax.train import checkpoint, run_dir as run_dir_lib
from nvfp4_jax.train.loop import run

ONE_DEVICE = jax.devices()[:1]
SMALL = ["model_name=tiny", "base_num_decoder_layers=1", "max_target_length=32", "per_device_batch_size=2",
         "quantization=bf16", "log_period=1", "eval_steps=1", "eval_interval=1000", "ici_fsdp_parallelism=1",
         "run_name=run"]


def _config(out, *extra):
    return load_config(SMALL + [f"base_output_directory={out}", *extra])


def _run(out, *extra):
    return run(_config(out, *extra), progress=False, devices=ONE_DEVICE)


def _steps(out):
    return sorted(int(n) for n in os.listdir(os.path.join(out, "run", "checkpoints")) if n.isdigit())


def _signal_at_batch(monkeypatch, step, signum=signal.SIGTERM):
    """Delivers `signum` to this process while the training batch of step index `step` loads."""
    load = data_lib.TokenBatches.batch

    def batch(self, i, *args, **kwargs):
        if self.split == "train" and i == step:
            os.kill(os.getpid(), signum)
        return load(self, i, *args, **kwargs)

    monkeypatch.setattr(data_lib.TokenBatches, "batch", batch)


# --- a run is finished only when its final evaluation is recorded --------------------------------


@pytest.mark.slow
def test_a_stop_in_the_last_step_is_finished_by_the_rerun(tmp_path, monkeypatch):
    reference = _run(tmp_path / "ref", "steps=3", "checkpoint_period=1", "max_checkpoints_to_keep=2")
    assert reference["final_eval_loss"] is not None

    out = tmp_path / "stopped"
    _signal_at_batch(monkeypatch, 2)  # step index 2 is the last of steps=3
    stopped = _run(out, "steps=3", "checkpoint_period=1", "max_checkpoints_to_keep=2")
    monkeypatch.undo()
    assert stopped["stopped_by"] == "SIGTERM" and stopped["step_reached"] == 3
    assert stopped["final_eval_loss"] is None and not run_dir_lib.is_finished(str(out / "run"))
    assert _steps(out) == [2, 3]

    resumed = _run(out, "steps=3", "checkpoint_period=1", "max_checkpoints_to_keep=2")
    assert resumed["stopped_by"] is None and resumed["step_reached"] == 3
    # The same state and held-out batches as the uninterrupted run: the same loss, bit for bit.
    assert resumed["final_eval_loss"] == reference["final_eval_loss"]
    assert run_dir_lib.is_finished(str(out / "run"), 3)
    assert run_dir_lib.read_summary(str(out / "run"))["final_eval_loss"] == reference["final_eval_loss"]

    # Rerunning a finished run evaluates again (the same bits) but logs the evaluation once, and
    # a lowered max_checkpoints_to_keep rotates even though nothing is saved.
    again = _run(out, "steps=3", "checkpoint_period=1", "max_checkpoints_to_keep=1")
    assert again["final_eval_loss"] == reference["final_eval_loss"]
    evals = [r for r in run_dir_lib.read_metrics(str(out / "run")) if "eval_loss" in r]
    assert [(r["step"], r["eval_loss"]) for r in evals] == [(3, reference["final_eval_loss"])]
    assert _steps(out) == [3]


def test_is_finished_needs_the_final_evaluation_at_the_last_step(tmp_path):
    def finished(**summary):
        run_dir_lib.write_summary(str(tmp_path), summary)
        return run_dir_lib.is_finished(str(tmp_path), 5)

    assert not run_dir_lib.is_finished(str(tmp_path))  # no summary at all
    assert finished(steps=5, step_reached=5, stopped_by=None, final_eval_loss=2.5)
    assert not finished(steps=5, step_reached=5, stopped_by=None, final_eval_loss=None)  # eval lost
    assert not finished(steps=5, step_reached=5, stopped_by="SIGTERM", final_eval_loss=None)
    assert not finished(steps=5, step_reached=3, stopped_by=None, final_eval_loss=2.5)
    assert not finished(steps=6, step_reached=6, stopped_by=None, final_eval_loss=2.5)  # another length
    (tmp_path / "summary.json").write_text('{"steps": 5, "final_')  # killed mid-write (older versions)
    assert not run_dir_lib.is_finished(str(tmp_path), 5)


# --- output paths ---------------------------------------------------------------------------------


def _history(run_dir):
    os.makedirs(run_dir, exist_ok=True)
    lines = [json.dumps({"step": s, "loss": 5.0 - s, "segment": 0}) + "\n" for s in (1, 2, 3)]
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(lines)
    return "".join(lines)


@pytest.mark.parametrize("where", ["checkpoints", "checkpoints/4"])
def test_a_checkpoint_path_that_is_a_file_is_refused_and_nothing_is_rewritten(tmp_path, where):
    run_dir = tmp_path / "run"
    history = _history(run_dir)
    os.makedirs(os.path.dirname(run_dir / where), exist_ok=True)
    (run_dir / where).write_text("not a folder")
    with pytest.raises(ConfigError, match=rf"{run_dir / where} is not a directory.*Move it away"):
        _run(tmp_path, "steps=3")
    assert (run_dir / "metrics.jsonl").read_text() == history  # the history is not rewritten
    assert (run_dir / where).read_text() == "not a folder"
    assert sorted(os.listdir(run_dir)) == sorted(["metrics.jsonl", where.split("/")[0]])  # no lock, no config


@pytest.mark.slow
def test_a_failed_save_in_a_run_names_the_intact_checkpoint_and_keeps_it(tmp_path, monkeypatch):
    save = ocp.CheckpointManager.save

    def full_disk(self, step, *args, **kwargs):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointError) as err:
        _run(tmp_path, "steps=3", "checkpoint_period=1")
    text = str(err.value)
    assert "\n" not in text
    assert "Saving checkpoint step 2" in text and "No space left on device" in text
    assert f"The last good (and intact) checkpoint is step 1 in {tmp_path / 'run' / 'checkpoints'}" in text
    assert _steps(tmp_path) == [1]
    assert not os.path.exists(tmp_path / "run" / "run.lock")  # released on the way out


class _FullDisk:
    """A file whose every write is refused like a full disk's."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    flush = write

    def close(self):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_under_metrics_and_summary_is_one_line_and_keeps_what_was_written(tmp_path, monkeypatch):
    history = _history(tmp_path)
    writer = run_dir_lib.MetricsWriter(str(tmp_path), start=3)
    writer._file.close()
    writer._file = _FullDisk()
    with pytest.raises(run_dir_lib.WriteError) as err:
        writer.write({"step": 4, "loss": 1.0})
    assert str(err.value) == f"Cannot write {tmp_path / 'metrics.jsonl'}: No space left on device"
    assert not writer.has(4, "loss")
    writer.close()  # what it could not flush was reported once, by write
    assert (tmp_path / "metrics.jsonl").read_text() == history

    run_dir_lib.write_summary(str(tmp_path), {"steps": 3})
    dump = json.dump

    def full(value, f, **kwargs):
        f.write("{\"steps\": ")  # half a file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", full)
    with pytest.raises(run_dir_lib.WriteError, match=r"Cannot write .*summary.json: No space left on device$"):
        run_dir_lib.write_summary(str(tmp_path), {"steps": 4})
    monkeypatch.setattr(json, "dump", dump)
    assert run_dir_lib.read_summary(str(tmp_path)) == {"steps": 3}  # the previous summary, whole
    assert not os.path.exists(tmp_path / "summary.json.tmp")


@pytest.mark.slow
def test_a_full_disk_under_metrics_mid_run_names_the_intact_checkpoint_and_the_rerun_loses_nothing(
        tmp_path, monkeypatch):
    reference = _run(tmp_path / "ref", "steps=4", "checkpoint_period=1")
    write = run_dir_lib.MetricsWriter.write

    def full_at_step_3(self, record):
        if record.get("step") == 3:
            self._file = _FullDisk()
        return write(self, record)

    monkeypatch.setattr(run_dir_lib.MetricsWriter, "write", full_at_step_3)
    with pytest.raises(run_dir_lib.WriteError) as err:
        _run(tmp_path, "steps=4", "checkpoint_period=1")
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"Cannot write {tmp_path / 'run' / 'metrics.jsonl'}: No space left on device. ")
    assert f"The last good checkpoint is step 2 in {tmp_path / 'run' / 'checkpoints'}" in text
    assert text.endswith("rerun the same command to resume.")
    assert _steps(tmp_path) == [1, 2]  # step 3's state, whose record was lost, was not saved
    assert not os.path.exists(tmp_path / "run" / "run.lock")

    monkeypatch.setattr(run_dir_lib.MetricsWriter, "write", write)
    resumed = _run(tmp_path, "steps=4", "checkpoint_period=1")
    assert resumed["resumed_from_step"] == 2
    losses = dict(run_dir_lib.iter_steps(run_dir_lib.read_metrics(str(tmp_path / "run")), "loss"))
    expected = dict(run_dir_lib.iter_steps(run_dir_lib.read_metrics(str(tmp_path / "ref" / "run")), "loss"))
    assert sorted(losses) == [1, 2, 3, 4] and losses == expected  # every step once, the same bits
    assert resumed["final_eval_loss"] == reference["final_eval_loss"]


# --- metrics.jsonl --------------------------------------------------------------------------------


def test_a_torn_line_in_the_middle_of_metrics_is_named_by_its_line(tmp_path):
    good = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join([good[0], '{"step": 2, "lo', *good[1:]]) + "\n")
    with pytest.raises(run_dir_lib.MetricsError, match=r"metrics.jsonl line 2 is not a JSON record"):
        run_dir_lib.read_metrics(str(tmp_path))
    writer = run_dir_lib.MetricsWriter(str(tmp_path), start=2)  # a resume names and drops it
    writer.close()
    assert writer.dropped == 1  # step 3's record; the torn line is reported apart, not counted
    assert writer.notes == [
        "metrics.jsonl: dropped 1 records logged after step 2 by an earlier segment (this one logs those "
        "steps again).",
        f"warning: {tmp_path / 'metrics.jsonl'} line 2 is not a JSON record; dropped it."]
    assert [r["step"] for r in run_dir_lib.read_metrics(str(tmp_path))] == [1, 2]


def test_a_torn_last_line_is_a_kill_and_is_skipped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + '\n{"step": 2, "lo')
    assert run_dir_lib.read_metrics(str(tmp_path)) == [{"step": 1, "loss": 1.0}]
    writer = run_dir_lib.MetricsWriter(str(tmp_path), start=1)
    writer.close()
    assert writer.dropped == 0
    assert writer.notes == ["metrics.jsonl: dropped its last line, cut short when an earlier segment was killed."]


# --- signals --------------------------------------------------------------------------------------

_BUSY_IN_C = textwrap.dedent("""
    import os, subprocess, numpy as np
    from nvfp4_jax.train.shutdown import StopRequest
    a = np.random.default_rng(0).standard_normal(12_000_000)
    with StopRequest() as stop:
        subprocess.Popen(["sh", "-c", f"sleep 0.2; kill -TERM {os.getpid()}; sleep 0.05; kill -TERM {os.getpid()}"])
        np.sort(a)  # one C call: no bytecode, hence no Python signal handler, until it returns
        print("survived", stop.signal_name, flush=True)
""")


def test_two_signals_50ms_apart_end_the_process_while_it_is_busy_in_c():
    proc = subprocess.run([sys.executable, "-c", _BUSY_IN_C], env=cli_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, (proc.stdout, proc.stderr)
    assert "survived" not in proc.stdout
    assert proc.stderr.count("received SIGTERM") == 1


def test_one_signal_is_only_a_request():
    one = _BUSY_IN_C.replace("; sleep 0.05; kill -TERM {os.getpid()}", "")
    # Wait for the one signal inside the block (a fast sort could end before it is sent).
    one = one.replace('    print("survived"', '    while stop.signal_name is None: __import__("time").sleep(0.01)\n    print("survived"')
    proc = subprocess.run([sys.executable, "-c", one], env=cli_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "survived SIGTERM", proc.stderr


# --- the same edges on real processes -------------------------------------------------------------


def _validation_line(proc):
    return next(line for line in proc.stdout if "validation loss:" in line).split(":")[1].strip()


@pytest.mark.slow
def test_sigterm_in_the_last_step_then_a_rerun_reports_the_final_validation_loss(tmp_path):
    for name in ("ref", "cut"):
        (tmp_path / name).mkdir()
    reference = Training(tmp_path / "ref")
    assert reference.finish() == 0, reference.stderr[-2000:]
    stopped = Training(tmp_path / "cut", hold_batch_at=5)  # step index 5 is the last of steps=6
    stopped.wait_for("WAITING_AT_BATCH 5")
    stopped.proc.send_signal(signal.SIGTERM)
    stopped.release()
    assert stopped.finish() == 75, stopped.stderr[-2000:]
    assert _validation_line(stopped) == "n/a"
    rerun = Training(tmp_path / "cut")
    assert rerun.finish() == 0, rerun.stderr[-2000:]
    assert _validation_line(rerun) == _validation_line(reference) != "n/a"
    assert run_dir_lib.is_finished(rerun.run_dir, 6)
    # max_checkpoints_to_keep (default 5 of period 2: steps 2, 4, 6 and the stop's 6) holds.
    assert sorted(os.listdir(os.path.join(rerun.run_dir, "checkpoints"))) == ["2", "4", "6"]


@pytest.mark.slow
def test_cli_checkpoints_that_is_a_file_is_exit_2_in_one_line(tmp_path):
    first = Training(tmp_path, "steps=2")
    assert first.finish() == 0
    history = open(os.path.join(first.run_dir, "metrics.jsonl")).read()
    ckpt = os.path.join(first.run_dir, "checkpoints")
    os.rename(ckpt, ckpt + ".moved")
    open(ckpt, "w").close()
    again = Training(tmp_path, "steps=4")
    assert again.finish() == 2
    assert again.stderr.strip().splitlines() == [
        f"error: {ckpt} is not a directory: checkpoints cannot be kept there, and the run would start over. "
        "Move it away (or start a new run: run_name=<a new name>)."]
    assert open(os.path.join(first.run_dir, "metrics.jsonl")).read() == history


@pytest.mark.slow
def test_cli_failed_save_is_exit_4_in_one_line_naming_the_intact_checkpoint(tmp_path):
    proc = Training(tmp_path, fail_save_at=4)
    assert proc.finish() == 4
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Saving checkpoint step 4 in "), proc.stderr[-3000:]
    assert "No space left on device" in lines[0]
    assert f"The last good (and intact) checkpoint is step 2 in {os.path.join(proc.run_dir, 'checkpoints')}" in lines[0]
    resumed = Training(tmp_path)  # space freed: the run goes on from step 2
    assert resumed.finish() == 0, resumed.stderr[-2000:]
    assert any(line.startswith("Resumed from checkpoint step 2") for line in resumed.stdout)


@pytest.mark.slow
def test_cli_truncated_manifest_without_fallback_is_one_line_and_no_traceback(tmp_path):
    first = Training(tmp_path, "steps=2")
    assert first.finish() == 0
    manifests = [os.path.join(root, name) for root, _, names in os.walk(os.path.join(first.run_dir, "checkpoints"))
                 for name in names if name == "manifest.ocdbt"]
    assert manifests
    for manifest in manifests:
        with open(manifest, "r+b") as f:
            f.truncate(os.path.getsize(manifest) // 2)
    again = Training(tmp_path, "steps=4", "checkpoint_fallback=false")
    assert again.finish() == 4
    lines = again.stderr.strip().splitlines()
    # The warning that names the damage, then the error; no orbax traceback after it.
    assert [line.split(":")[0] for line in lines] == ["warning", "error"], again.stderr[-3000:]
    assert lines[1].startswith("error: Checkpoint step 2 ") and "checkpoint_fallback=false forbids" in lines[1]
    assert "Traceback" not in again.stderr and "Event loop" not in again.stderr
