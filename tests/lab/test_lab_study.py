"""The lab end to end: the command line on a fresh folder, and a study surviving a kill."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys

import jax
import pytest

from nvfp4_jax.lab import parse_arms, run_study

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model_name=tiny", "base_num_decoder_layers=2", "max_target_length=64", "per_device_batch_size=8",
        "log_period=1", "eval_steps=1", "ici_fsdp_parallelism=1"]
ONE_DEVICE = jax.devices()[:1]
PNG = b"\x89PNG\r\n\x1a\n"


def _lab(*args, cwd):
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's machine has
    return subprocess.run([sys.executable, "-m", "nvfp4_jax.lab", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_two_arm_two_step_lab_from_the_command_line(tmp_path):
    out = tmp_path / "study"
    done = _lab(*TINY, "steps=2", "eval_interval=1", "quant_stats=true",
                "--arms", "bf16", "te_nvfp4", "--seeds", "1", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["study"]["seeds"] == [0] and results["study"]["steps"] == 2
    assert [a["name"] for a in results["study"]["arms"]] == ["bf16", "te_nvfp4"]
    by_arm = {r["arm"]: r for r in results["runs"]}
    assert sorted(by_arm) == ["bf16", "te_nvfp4"]
    for arm, r in by_arm.items():
        assert r["seed"] == 0 and r["status"] == "trained"
        assert math.isfinite(r["final_eval_loss"]) and 3.0 < r["final_eval_loss"] < 6.0
        assert [p[0] for p in r["loss_curve"]] == [2] and [p[0] for p in r["eval_losses"]] == [1, 2]
        assert r["eval_losses"][-1][1] == r["final_eval_loss"] and r["tokens_per_second_per_device"] > 0
        summary = json.loads((out / r["run_directory"] / "summary.json").read_text())
        assert summary["final_eval_loss"] == r["final_eval_loss"]
    assert by_arm["bf16"]["quant_stats"] is None
    health = by_arm["te_nvfp4"]["quant_stats"]
    assert sorted(health) == [f"layers_{i}/mlp/{p}" for i in (0, 1) for p in ("down", "gate", "up")]
    assert set(health["layers_1/mlp/up"]) == {"x", "w", "dy", "x_wgrad", "dy_wgrad"}

    rows = {row["arm"]: row for row in results["summary"]}
    gap = by_arm["te_nvfp4"]["final_eval_loss"] - by_arm["bf16"]["final_eval_loss"]
    assert rows["te_nvfp4"]["gap_nats"] == pytest.approx(gap, abs=1e-12)
    assert rows["te_nvfp4"]["welch_p"] is None  # one seed: no test, and the table says so
    table = (out / "summary.md").read_text()
    assert "| `bf16` | 1 |" in table and "(reference)" in table
    bf16_forward = by_arm["te_nvfp4"]["final_eval_loss_bf16"]
    assert f"| `te_nvfp4` | 1 | {rows['te_nvfp4']['mean']:.4f} ± n/a | {bf16_forward:.4f} ± n/a |" in table
    assert f"| {gap:+.4f} |" in table
    # The lab evaluates both ways: BF16's two evaluations are one; NVFP4's differ (FP4 at eval time).
    assert by_arm["bf16"]["final_eval_loss_bf16"] == by_arm["bf16"]["final_eval_loss"]
    assert bf16_forward != by_arm["te_nvfp4"]["final_eval_loss"]
    assert [p[0] for p in by_arm["te_nvfp4"]["eval_losses_bf16"]] == [1, 2]
    assert results["study"]["provenance"]["commit"] and "## Conclusions" in table

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "Plots: skipped" in table
        return
    pngs = ["loss_curves.png", "gap_to_bf16.png", "quant_health.png", "quant_health_te_nvfp4.png"]
    assert sorted(results["study"]["plots"]) == sorted(pngs)
    for name in pngs:
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name


def test_a_bad_arm_stops_the_lab_before_anything_runs(tmp_path):
    done = _lab("--arms", "bf16", "x:learning_rat=1", "--out", str(tmp_path / "study"), cwd=tmp_path)
    assert done.returncode == 2
    assert "learning_rat" in done.stderr and "learning_rate" in done.stderr
    assert not (tmp_path / "study").exists()


@pytest.mark.slow
def test_a_killed_study_resumes_its_interrupted_run_and_reads_back_the_finished_one(tmp_path):
    # Steps, evaluations and statistics as in the command-line test above: its compiled programs
    # are in the session's compilation cache.
    args = TINY + ["steps=2", "checkpoint_period=1", "max_checkpoints_to_keep=2", "eval_interval=1",
                   "quant_stats=true"]
    arms = parse_arms(["bf16", "te_nvfp4"])
    kwargs = dict(seeds=1, out_dir=str(tmp_path), make_plots=False, curve_window=10, devices=ONE_DEVICE)
    first = run_study(args, arms, **kwargs, log=lambda _: None)
    assert [r["status"] for r in first["runs"]] == ["trained", "trained"]

    # As if the lab had been killed in te_nvfp4 after its step-1 checkpoint, mid-way through a line.
    killed = tmp_path / "runs" / "te_nvfp4-seed0"
    os.remove(killed / "summary.json")
    shutil.rmtree(killed / "checkpoints" / "2")
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    kept = [l for l in lines if json.loads(l)["step"] <= 1]
    (killed / "metrics.jsonl").write_text("\n".join(kept) + '\n{"step": 2, "los')
    finished = tmp_path / "runs" / "bf16-seed0" / "metrics.jsonl"
    before = (finished.stat().st_mtime_ns, finished.read_bytes())

    messages = []
    second = run_study(args, arms, **kwargs, log=messages.append)
    assert [r["status"] for r in second["runs"]] == ["reused", "resumed"]
    assert (finished.stat().st_mtime_ns, finished.read_bytes()) == before  # not rerun
    assert "bf16 seed 0: reused" in messages[0] and "te_nvfp4 seed 0: resumed" in messages[1]
    # Resuming reproduces the uninterrupted run: same curve (steps 1-2), evals and final loss.
    for key in ("loss_curve", "eval_losses", "final_eval_loss", "quant_stats"):
        assert second["runs"][1][key] == first["runs"][1][key], key
    losses = lambda study: [(row["arm"], row["final_eval_losses"]) for row in study["summary"]]
    assert losses(second) == losses(first)


def test_a_run_held_by_another_process_stops_the_lab_with_one_line(tmp_path):
    # As if a second lab (or a training run on another host) were training bf16-seed0 right now.
    held = tmp_path / "study" / "runs" / "bf16-seed0"
    held.mkdir(parents=True)
    (held / "run.lock").write_text(json.dumps({"host": "another-host", "pid": 1, "since": "then"}))
    done = _lab(*TINY, "steps=2", "--arms", "bf16", "--seeds", "1", "--out", str(tmp_path / "study"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "error:" in done.stderr and "in use by pid 1 on host another-host" in done.stderr
    assert (held / "run.lock").exists() and not (held / "checkpoints").exists()


@pytest.mark.slow
def test_sigterm_to_the_lab_process_after_its_first_run_stops_it_with_75_and_a_rerun_finishes(tmp_path):
    out = tmp_path / "study"
    args = [*TINY, "steps=2", "eval_interval=1000", "checkpoint_period=1", "--arms", "bf16", "te_nvfp4",
            "--seeds", "1", "--out", str(out), "--no_plots"]
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, "-m", "nvfp4_jax.lab", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("[lab] 1/2 bf16 seed 0: trained"):
            proc.send_signal(signal.SIGTERM)  # between the arms, or early in the second one
    assert proc.wait(timeout=600) == 75, "".join(seen)[-3000:]
    results = json.loads((out / "results.json").read_text())
    # The signal reached either the lab between the runs, or the second run (which saved and
    # stopped: not reported), or the second run's set-up before its loop listened (it then
    # finished, fully evaluated). Never a run reported without its final evaluation.
    first = [r["arm"] for r in results["runs"]]
    assert first in (["bf16"], ["bf16", "te_nvfp4"])
    assert all(r["final_eval_loss"] is not None for r in results["runs"])
    assert any("stopped by SIGTERM" in l for l in seen)
    assert not any("final validation loss n/a" in l for l in seen)
    done = _lab(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [(r["arm"], r["status"]) for r in results["runs"]][0] == ("bf16", "reused")
    # A second run that finished before the signal is reused; one that was stopped resumes or
    # (stopped before its first save) trains again.
    assert results["runs"][1]["status"] in (("reused",) if "te_nvfp4" in first else ("trained", "resumed"))
    assert all(math.isfinite(r["final_eval_loss"]) and math.isfinite(r["final_eval_loss_bf16"]) for r in results["runs"])


@pytest.mark.slow
def test_a_run_stopped_in_its_last_step_gets_its_final_evaluation_and_check_reproduces_it(tmp_path):
    args = TINY + ["steps=2", "eval_interval=1000", "checkpoint_period=1"]
    kwargs = dict(seeds=1, out_dir=str(tmp_path), make_plots=False, devices=ONE_DEVICE, log=lambda _: None)
    first = run_study(args, parse_arms(["te_nvfp4"]), **kwargs)
    want = first["runs"][0]
    assert want["final_eval_loss"] != want["final_eval_loss_bf16"]  # evaluated both ways (lab default)
    # State 1: stopped by a signal in its last step, checkpoint saved, no final evaluation.
    run_dir = tmp_path / "runs" / "te_nvfp4-seed0"
    lines = [l for l in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval_loss" not in l]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(stopped_by="SIGTERM", final_eval_loss=None, final_eval_loss_bf16=None)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    second = run_study(args, parse_arms(["te_nvfp4"]), **kwargs)
    got = second["runs"][0]
    assert got["status"] == "resumed"
    assert (got["final_eval_loss"], got["final_eval_loss_bf16"]) == (want["final_eval_loss"], want["final_eval_loss_bf16"])
    assert second["summary"][0]["seeds"] == [0]
    # --check re-runs it in a fresh directory on the same single device: bit for bit.
    from nvfp4_jax.lab import check

    assert check.check(str(tmp_path / "results.json"), devices=ONE_DEVICE, log=lambda _: None)
