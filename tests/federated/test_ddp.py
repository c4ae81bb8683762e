"""`python -m nvfp4_jax.federated.ddp`: per-process shares of a fixed global batch from the command
line, its decision log, and a resume that continues exactly."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from nvfp4_jax.cli import Exit
from nvfp4_jax.federated import ddp
from nvfp4_jax.federated.budget import SiteCost
from nvfp4_jax.federated.shares import Progress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP32 = ["model_name=tiny", "base_num_decoder_layers=1", "max_target_length=16", "per_device_batch_size=8",
        "ici_fsdp_parallelism=1", "quantization=bf16", "dtype=float32", "eval_steps=1"]


@pytest.mark.parametrize("argv, message", [
    (["--processes", "0"], "--processes=0 must be at least 1"),
    (["--processes", "2", "--period", "0"], "--period=0 must be at least 1"),
    (["--processes", "2", "--policy", "fastest"], "--policy='fastest' is not allowed: one of equal, static, adaptive"),
    (["--processes", "2", "--slowdown", "4"], "--slowdown='4' must be 2 factors (one per worker), each >= 1"),
    (["--processes", "2", "--slowdown", "0.5,1"], "each >= 1"),
    (["--processes", "2", "--slowdown", "a,b"], "must be 2 comma-separated numbers"),
    (["--processes", "2", "--microbatch", "3"], "per_device_batch_size=8 (the global batch here) must be a multiple of --microbatch=3"),
    (["--processes", "3", "--microbatch", "4"], "2 microbatches cannot give each of --processes=3 workers one"),
    (["--processes", "2", "--resume"], "shares.json does not exist"),
    (["--processes", "2", "--no-such-option"], "unrecognized arguments: --no-such-option"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert ddp.main(argv + FP32 + [f"base_output_directory={tmp_path}"]) == Exit.BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("flag", ["quantization=te_fp8_delayedscaling", "vision_quantization=te_fp8_delayedscaling"])
def test_delayed_scaling_fp8_is_refused_in_one_line(tmp_path, capsys, flag):
    # Its amax histories are train-step state that a shares step neither updates nor combines.
    assert ddp.main(["--processes", "2", *FP32, flag, f"base_output_directory={tmp_path}"]) == Exit.BAD_INPUT
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {flag}: delayed scaling"), err


def test_the_equal_split_gives_every_worker_at_least_one_and_adds_up():
    assert ddp.equal_split(8, 2) == [4, 4]
    assert ddp.equal_split(7, 3) == [3, 2, 2]
    assert ddp.equal_split(3, 3) == [1, 1, 1]


def test_a_resume_reads_back_the_state_split_and_costs_and_a_failed_save_keeps_the_last_pair(tmp_path, monkeypatch):
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": np.int32(2)}
    periods = [ddp_record(2)]
    header = {"processes": 2}
    ddp.save_progress(str(tmp_path), Progress(2, state, [5, 3], [SiteCost(0.5), SiteCost(0.25)], periods),
                      [1.5, 1.25], header)
    template = {"w": np.zeros((2, 3), np.float32), "step": np.int32(0)}
    progress, losses = ddp.load_progress(str(tmp_path), template)
    np.testing.assert_array_equal(progress.state["w"], state["w"])
    assert (progress.step, progress.split, losses) == (2, [5, 3], [1.5, 1.25])
    assert [c.seconds_per_sample for c in progress.costs] == [0.5, 0.25]
    assert progress.periods == periods

    # A crash while the next log is written: its state file may exist, the log still names step 2's.
    real = ddp._write_atomically

    def crash_on_the_log(path, data):
        if path.endswith(ddp.SHARES_LOG):
            raise OSError("disk full")
        real(path, data)

    monkeypatch.setattr(ddp, "_write_atomically", crash_on_the_log)
    later = {"w": state["w"] + 1, "step": np.int32(4)}
    with pytest.raises(OSError):
        ddp.save_progress(str(tmp_path), Progress(4, later, [6, 2], [SiteCost(1.0)] * 2, periods * 2), [1.0] * 4, header)
    progress, losses = ddp.load_progress(str(tmp_path), template)
    assert progress.step == 2 and losses == [1.5, 1.25]
    np.testing.assert_array_equal(progress.state["w"], state["w"])


def ddp_record(step):
    from nvfp4_jax.federated.shares import period_record

    return period_record(step, [4, 4], [5, 3], [1.0, 2.0], [2.5, 2.5], [SiteCost(0.5), SiteCost(0.25)])


def test_a_period_record_holds_each_workers_idle_time_at_the_barrier():
    record = ddp_record(2)
    assert record["idle_s"] == [1.5, 0.5] and record["trained_with"] == [4, 4] and record["microbatches"] == [5, 3]


def _ddp(tmp_path, name, *args, config=FP32):
    out = subprocess.run(
        [sys.executable, "-m", "nvfp4_jax.federated.ddp", "--processes", "2", "--period", "2", *args, *config,
         f"base_output_directory={tmp_path}", f"run_name={name}"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
                           XLA_FLAGS="--xla_force_host_platform_device_count=1"),
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    with open(tmp_path / name / ddp.SHARES_LOG) as f:
        return json.load(f), out.stdout


@pytest.mark.slow  # three 2-process runs on CPU: a few minutes
def test_adaptive_shares_stopped_and_resumed_train_the_same_losses_as_an_equal_split(tmp_path):
    equal, _ = _ddp(tmp_path, "equal", "--policy", "equal", "--steps", "4")
    assert [p["microbatches"] for p in equal["periods"]] == [[4, 4], [4, 4]]
    # Worker 0 four times slower: the adaptive controller moves microbatches to worker 1.
    first, out = _ddp(tmp_path, "adaptive", "--policy", "adaptive", "--slowdown", "4,1", "--steps", "2")
    decided = first["next_microbatches"]
    assert decided[0] < 4 and sum(decided) == 8 and min(decided) >= 1, first["periods"]
    assert "[ddp] shares: step=2 microbatches=" in out
    resumed, out = _ddp(tmp_path, "adaptive", "--policy", "adaptive", "--slowdown", "4,1", "--steps", "4", "--resume")
    assert resumed["periods"][0] == first["periods"][0]  # the log goes on
    assert resumed["periods"][1]["trained_with"] == decided  # the resume trains with the decision made
    assert "[ddp] step=3 loss=" in out and "[ddp] step=1 loss=" not in out
    # Any split trains the global batch's token-weighted mean gradient: the same losses (fp32).
    np.testing.assert_allclose(resumed["losses"], equal["losses"], rtol=1e-6)
    assert len(resumed["losses"]) == 4 and resumed["makespan_s"] > first["makespan_s"]


@pytest.mark.slow  # two 2-process runs on CPU: about two minutes
def test_nvfp4_shares_train_the_same_losses_whatever_the_split(tmp_path):
    # Stochastic rounding draws from each microbatch's own key (its position in the
    # global batch), so a worker's share changes which process computes a microbatch, not its bits.
    nvfp4 = [a if not a.startswith("quantization=") else "quantization=te_nvfp4" for a in FP32]
    equal, _ = _ddp(tmp_path, "equal", "--policy", "equal", "--steps", "4", config=nvfp4)
    adaptive, _ = _ddp(tmp_path, "adaptive", "--policy", "adaptive", "--slowdown", "4,1", "--steps", "4", config=nvfp4)
    assert adaptive["periods"][0]["microbatches"][0] < 4  # the split moved
    np.testing.assert_allclose(adaptive["losses"], equal["losses"], rtol=1e-6)
