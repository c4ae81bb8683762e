"""Two processes on jax.distributed (CPU, gloo) training shares 3:1 of one global batch match a
single-process run of that batch; a 4x slowdown on the first moves its shares to the other."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

WORKER = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    from nvfp4_jax.config import load_config
    from nvfp4_jax.federated import shares
    from nvfp4_jax.train import assembly
    cfg = load_config(json.loads(sys.argv[3]))
    run = assembly.assemble(cfg, jax.local_devices()[:1])
    state, losses, history = shares.train_shares(run, microbatch=2, initial=[3, 1], steps=4, period=2,
                                                 slowdown=4.0 if sys.argv[2] == "0" else 1.0)
    params = [float(abs(x).sum()) for x in jax.tree.leaves(state.params)]
    print("RESULT " + json.dumps({"losses": losses, "history": history, "params": params}), flush=True)
""")

REFERENCE = textwrap.dedent("""
    import json, sys
    import jax
    from nvfp4_jax.config import load_config
    from nvfp4_jax.train import assembly
    run = assembly.assemble(load_config(json.loads(sys.argv[1])), jax.devices()[:1])
    state, data, losses = run.init_state(), run.dataset("train"), []
    for step in range(4):
        state, m = run.train_step(state, run.put(data.batch(step)))
        losses.append(float(m["loss"]))
    params = [float(abs(x).sum()) for x in jax.tree.leaves(state.params)]
    print("RESULT " + json.dumps({"losses": losses, "params": params}), flush=True)
""")

FP32 = ["model_name=tiny", "base_num_decoder_layers=1", "max_target_length=16", "per_device_batch_size=8",
        "ici_fsdp_parallelism=1", "quantization=bf16", "dtype=float32", "eval_steps=1"]


def _result(out):
    return json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][7:])


@pytest.mark.slow  # two processes and a reference process: about a minute on CPU
def test_two_processes_with_shares_3_to_1_match_one_process_and_the_slow_one_loses_shares(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    args = json.dumps(FP32)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, f"localhost:{port}", str(i), args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    ref = subprocess.run([sys.executable, "-c", REFERENCE, args], env=env, capture_output=True, text=True,
                         timeout=300)
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = _result(ref.stdout)
    for out, err in outs:
        got = _result(out)
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-6)
        np.testing.assert_allclose(got["params"], expected["params"], rtol=1e-6)
        assert got["history"][0] == [3, 1] and got["history"][1][0] < 3 and sum(got["history"][1]) == 4
        assert "shares: step=2 microbatches=" in out  # the controller's decision, logged
