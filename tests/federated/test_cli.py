"""`python -m nvfp4_jax.federated`: settings become a FLARE job spec; bad ones are one line, exit 2."""

import os
import subprocess
import sys

import pytest

from nvfp4_jax.config import ConfigError
from nvfp4_jax.federated.__main__ import build_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_spec_from_the_command_line(tmp_path):
    spec, _, corpus = build_spec([
        "--sites", "3", "--rounds", "4", "--budget", "static", "--slowdown", "1,2,4",
        "--update", "subset", "--trainable", "mlp", "--compression", "nvfp4",
        "per_device_batch_size=2", f"base_output_directory={tmp_path}", "quantization=te_fp8_currentscaling"])
    assert [s.name for s in spec.sites] == ["site-1", "site-2", "site-3"]
    assert [s.slowdown for s in spec.sites] == [1.0, 2.0, 4.0]
    assert spec.policy.name == "static" and spec.policy.quantum == 2 and spec.policy.total_samples == 24
    assert spec.contract.kind == "subset" and spec.contract.compression == "nvfp4"
    # The learning-rate schedule spans the expected local steps: 4 rounds x 4 steps.
    assert spec.run_config["steps"] == 16 and spec.run_config["quantization"] == "te_fp8_currentscaling"
    assert corpus is not None and all(s.data_path.endswith(f"{s.name}.txt") for s in spec.sites)


@pytest.mark.parametrize("argv, message", [
    (["--sites", "0"], "--sites=0"),
    (["--rounds", "0"], "--rounds=0"),
    (["--budget", "fast"], "budget='fast'"),
    (["--sites", "2", "--slowdown", "1,2,3"], "gives 3 values for 2 sites"),
    (["--sites", "2", "--slowdown", "1,0.5"], "must be >= 1"),
    (["--update", "full", "--compression", "fp8"], "compresses differences"),
    (["--privacy", "gaussian", "--compression", "nvfp4"], "filters uncompressed differences"),
    (["--privacy", "laplace"], "--privacy='laplace'"),
    (["--privacy", "gaussian"], "--noise-multiplier=0.0 must be positive"),
    (["--privacy", "gaussian", "--noise-multiplier", "-1"], "--noise-multiplier=-1.0 must be positive"),
    (["--sites", "2", "--site-data", "/no/such/file"], "given 1 times for --sites=2"),
    (["--sites", "1", "--site-data", "/no/such/file"], "is not a file"),
    (["--samples-per-round", "14"], "multiple of the global batch"),
    (["--frobnicate"], "unknown option '--frobnicate'"),
    (["quantization=te_nvfp5"], "quantization"),
])
def test_bad_settings_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        build_spec(argv)


def test_a_bad_setting_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "nvfp4_jax.federated", "--sites", "2", "--slowdown", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: --slowdown='1' gives 1 values for 2 sites"]


def test_export_writes_a_flare_job_folder(tmp_path):
    pytest.importorskip("nvflare")
    from nvfp4_jax.federated import job as job_lib

    spec, _, _ = build_spec(["--sites", "2", "--privacy", "gaussian", "--noise-multiplier", "0.1",
                             f"base_output_directory={tmp_path}"])
    where = job_lib.export(spec, str(tmp_path / "jobs"))
    assert sorted(os.listdir(where)) == ["app_server", "app_site-1", "app_site-2", "meta.json"]
    server = (tmp_path / "jobs" / spec.name / "app_server" / "config" / "config_fed_server.json").read_text()
    assert "BudgetedFedAvg" in server and '"num_rounds": 3' in server
    client = (tmp_path / "jobs" / spec.name / "app_site-1" / "config" / "config_fed_client.json").read_text()
    assert "GaussianPrivacy" in client and "client.py" in client
    # The site's filter gets no seed: it draws its noise from the OS, not from anything in the job.
    import json
    (site_filter,) = [f for entry in json.loads(client)["task_result_filters"] for f in entry["filters"]]
    assert site_filter["args"] == {"noise_multiplier": 0.1}
