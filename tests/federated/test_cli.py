"""`python -m nvfp4_jax.federated`: settings become a FLARE job spec; bad ones are one line, exit 2."""

import json
import os
import re
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
    assert spec.weighting == "data"  # FedAvg's own definition unless told otherwise
    assert build_spec(["--weighting", "samples", f"base_output_directory={tmp_path}"])[0].weighting == "samples"


def test_silos_of_unequal_device_counts_from_the_command_line(tmp_path):
    spec, _, _ = build_spec(["--sites", "3", "--site-devices", "1,2,4", "per_device_batch_size=2",
                             f"base_output_directory={tmp_path}"])
    assert [s.devices for s in spec.sites] == [1, 2, 4]
    assert [s.device_offset for s in spec.sites] == [0, 1, 3]  # devices 0 | 1-2 | 3-6
    # Each site's budget is a multiple of its own global batch; the round total defaults to four
    # steps of the smallest site's batch per site.
    assert spec.policy.site_quanta == (2, 4, 8) and spec.policy.quantum == 2 and spec.policy.total_samples == 24
    same, _, _ = build_spec(["--sites", "2", "--site-devices", "2", "per_device_batch_size=2",
                             f"base_output_directory={tmp_path}"])
    assert [s.devices for s in same.sites] == [2, 2] and same.policy.site_quanta == () and same.policy.quantum == 4


def test_per_device_shares_inside_silos_from_the_command_line(tmp_path):
    spec, _, _ = build_spec(["--sites", "2", "--site-devices", "1,2", "--silo-shares", "adaptive",
                             "--silo-microbatch", "2", "--device-slowdown", "site-2=1,3", "--ema", "0.7",
                             "per_device_batch_size=2", f"base_output_directory={tmp_path}"])
    assert (spec.silo.name, spec.silo.microbatch, spec.silo.ema) == ("adaptive", 2, 0.7)
    assert [s.device_slowdown for s in spec.sites] == [(), (1.0, 3.0)]
    pytest.importorskip("nvflare")
    from nvfp4_jax.federated import job as job_lib

    # What each site's client script is told: its devices' policy and its own stretch.
    where = job_lib.export(spec, str(tmp_path / "jobs"))
    with open(os.path.join(where, "app_site-2", "config", "config_fed_client.json")) as f:
        client = json.load(f)
    text = json.dumps(client)
    (args,) = re.findall(r'"task_script_args": "([^"]*)"', text)
    assert "--silo-shares adaptive --silo-microbatch 2 --silo-ema 0.7" in args and "--device-slowdown 1.0,3.0" in args
    # Off by default: FSDP inside a site, nothing passed.
    off, _, _ = build_spec(["--sites", "2", "--site-devices", "2", f"base_output_directory={tmp_path}"])
    assert not off.silo.on


@pytest.mark.parametrize("argv, message", [
    (["--sites", "2", "--site-devices", "1,2", "--silo-shares", "fastest"], "silo shares 'fastest' is not allowed"),
    (["--sites", "2", "--silo-shares", "adaptive"], "give some site several (--site-devices 2"),
    (["--sites", "2", "--site-devices", "2", "--silo-shares", "adaptive", "--silo-microbatch", "3",
      "per_device_batch_size=2"], "--silo-microbatch=3 must be >= 1 and divide the site's 4 rows"),
    (["--sites", "2", "--site-devices", "2", "--silo-shares", "adaptive", "--silo-microbatch", "4",
      "per_device_batch_size=2"], "every device needs at least one"),
    (["--sites", "2", "--site-devices", "2", "--device-slowdown", "site-1=1,2"], "give --silo-shares"),
    (["--sites", "2", "--site-devices", "1,2", "--silo-shares", "equal", "--device-slowdown", "site-3=1,2"],
     "'site-3' is not a site"),
    (["--sites", "2", "--site-devices", "1,2", "--silo-shares", "equal", "--device-slowdown", "site-1=2"],
     "site-1 has one device; slow it with --slowdown"),
    (["--sites", "2", "--site-devices", "1,2", "--silo-shares", "equal", "--device-slowdown", "site-2=1,2,3"],
     "site-2 has 2 devices; give 2 comma-separated factors >= 1"),
    (["--sites", "2", "--site-devices", "1,2", "--silo-shares", "equal", "--device-slowdown", "site-2=1,0.5"],
     "factors >= 1"),
    (["--sites", "2", "--site-devices", "1,2", "--silo-shares", "equal", "--device-slowdown", "site-2=1,2",
      "--device-slowdown", "site-2=1,3"], "names site-2 twice"),
    (["--sites", "2", "--site-devices", "1,2,4"], "--site-devices='1,2,4' gives 3 counts for 2 sites"),
    (["--sites", "2", "--site-devices", "0"], "every count must be at least 1"),
    (["--sites", "2", "--site-devices", "two"], "must be a whole number, or 2 comma-separated ones"),
    (["--sites", "2", "--site-devices", "2,3"], "global batches 8, 12 (rows a device x the site's devices) must all be multiples of the smallest (8)"),
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
    (["--dp-delta", "0"], "--dp-delta=0.0 must be in (0, 1)"),
    (["--dp-delta", "1"], "--dp-delta=1.0 must be in (0, 1)"),
    (["--dp-delta=-1e-5"], "--dp-delta=-1e-05 must be in (0, 1)"),
    (["--privacy", "percentile", "--percentile", "100"], "--percentile=100.0 must be in [0, 100)"),
    (["--privacy", "percentile", "--percentile", "-1"], "--percentile=-1.0 must be in [0, 100)"),
    (["--privacy", "percentile", "--gamma", "0"], "--gamma=0.0 must be positive"),
    (["--privacy", "svt", "--svt-fraction", "0"], "--svt-fraction=0.0 must be in (0, 1]"),
    (["--privacy", "svt", "--svt-fraction", "1.5"], "--svt-fraction=1.5 must be in (0, 1]"),
    (["--privacy", "svt", "--svt-epsilon", "-1"], "--svt-epsilon=-1.0 must be positive"),
    (["--privacy", "svt", "--svt-noise-var", "0"], "--svt-noise-var=0.0 must be positive"),
    (["--privacy", "svt", "--svt-gamma", "inf"], "--svt-gamma=inf must be positive and finite"),
    (["--privacy", "gaussian", "--noise-multiplier", "1", "--svt-fraction", "0.5"],
     "--svt-fraction is an option of --privacy svt, not of --privacy gaussian"),
    (["--gamma", "0.1"], "--gamma is an option of --privacy percentile, not of --privacy none"),
    (["--site-privacy", "site-9=gaussian:noise_multiplier=1"], "'site-9' is not a site of this job"),
    (["--site-privacy", "site-1=laplace"], "'laplace' is not one of none, percentile, svt, gaussian"),
    (["--site-privacy", "site-1=gaussian:sigma=1"], "--site-privacy site-1=gaussian:sigma is not an option of gaussian"),
    (["--site-privacy", "site-1=gaussian:noise_multiplier=big"], "noise_multiplier='big' is not a number"),
    (["--site-privacy", "site-1=gaussian:noise_multiplier"], "'noise_multiplier' must be key=value"),
    (["--site-privacy", "site-1"], "must be SITE=FILTER[:key=value,...]"),
    (["--site-privacy", "site-1=gaussian"], "--site-privacy site-1=gaussian:noise_multiplier=0.0 must be positive"),
    (["--site-privacy", "site-2=svt:fraction=2"], "--site-privacy site-2=svt:fraction=2.0 must be in (0, 1]"),
    (["--site-privacy", "site-1=svt", "--site-privacy", "site-1=percentile"], "names site-1 twice"),
    (["--site-privacy", "site-1=svt", "--compression", "fp8"], "filters uncompressed differences"),
    (["quantization=te_nvfp5"], "quantization"),
    (["--weighting", "tokens"], "--weighting='tokens' is not allowed: one of data, samples"),
])
def test_bad_settings_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_spec(argv)


def test_privacy_policies_from_the_command_line(tmp_path):
    spec, _, _ = build_spec([
        "--sites", "3", "--privacy", "svt", "--svt-fraction", "0.2", "--svt-noise-var", "0.05", "--dp-delta", "1e-6",
        "--site-privacy", "site-2=gaussian:noise_multiplier=2.0,clip_norm=0.5", "--site-privacy", "site-3=none",
        f"base_output_directory={tmp_path}"])
    assert spec.dp_delta == 1e-6
    assert spec.privacy_of("site-1") == {"filter": "svt", "fraction": 0.2, "epsilon": 0.1, "noise_var": 0.05,
                                         "gamma": 1e-5}
    assert spec.privacy_of("site-2") == {"filter": "gaussian", "clip_norm": 0.5, "noise_multiplier": 2.0}
    assert spec.privacy_of("site-3") == {"filter": "none"}


@pytest.mark.parametrize("argv, line", [
    (["--sites", "2", "--slowdown", "1"], "error: --slowdown='1' gives 1 values for 2 sites"),
    (["--dp-delta", "2"], "error: --dp-delta=2.0 must be in (0, 1), exclusive (e.g. 1e-5)"),
    (["--site-privacy", "site-4=svt"], "error: --site-privacy 'site-4=svt': 'site-4' is not a site of this job "
                                       "(site-1, site-2, site-3)"),
])
def test_a_bad_setting_is_one_line_and_exit_2(argv, line):
    proc = subprocess.run([sys.executable, "-m", "nvfp4_jax.federated", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [line]


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
    (site_filter,) = [f for entry in json.loads(client)["task_result_filters"] for f in entry["filters"]]
    assert site_filter["args"] == {"noise_multiplier": 0.1}


def _exported_filters(tmp_path, argv) -> dict:
    """{site: [(filter class, its args)]} from the exported job folder's per-site configs."""
    from nvfp4_jax.federated import job as job_lib

    spec, _, _ = build_spec([*argv, f"base_output_directory={tmp_path}"])
    where = job_lib.export(spec, str(tmp_path / "jobs"))
    filters = {}
    for site in spec.sites:
        with open(os.path.join(where, f"app_{site.name}", "config", "config_fed_client.json")) as f:
            config = json.load(f)
        # (less FLARE's own data_kinds argument)
        filters[site.name] = [(flt["path"].rsplit(".", 1)[-1],
                               {k: v for k, v in flt["args"].items() if k != "data_kinds"})
                              for entry in config.get("task_result_filters", []) for flt in entry["filters"]]
    return filters


def test_percentile_and_svt_options_arrive_in_the_filter(tmp_path):
    pytest.importorskip("nvflare")
    percentile = _exported_filters(tmp_path / "p", ["--sites", "1", "--privacy", "percentile",
                                                    "--percentile", "75", "--gamma", "0.2"])
    assert percentile == {"site-1": [("PercentilePrivacy", {"percentile": 75.0, "gamma": 0.2})]}
    svt = _exported_filters(tmp_path / "s", ["--sites", "1", "--privacy", "svt", "--svt-fraction", "0.3",
                                             "--svt-epsilon", "0.7", "--svt-noise-var", "0.02", "--svt-gamma", "0.5"])
    assert svt == {"site-1": [("SVTPrivacy", {"fraction": 0.3, "epsilon": 0.7, "noise_var": 0.02, "gamma": 0.5})]}


def test_each_site_gets_its_own_filter_in_its_own_config(tmp_path):
    pytest.importorskip("nvflare")
    filters = _exported_filters(tmp_path, [
        "--sites", "3", "--privacy", "gaussian", "--noise-multiplier", "1.5", "--dp-delta", "1e-6",
        "--site-privacy", "site-2=gaussian:noise_multiplier=2.0,clip_norm=0.5", "--site-privacy", "site-3=none"])
    assert filters == {"site-1": [("GaussianPrivacy", {"noise_multiplier": 1.5})],
                       "site-2": [("GaussianPrivacy", {"clip_norm": 0.5, "noise_multiplier": 2.0})],
                       "site-3": []}
    # The server's accountant knows every site's policy and the delta.
    server = json.loads((tmp_path / "jobs" / "nvfp4_jax_fedavg" / "app_server" / "config" /
                         "config_fed_server.json").read_text())
    (args,) = [c["args"] for c in server["workflows"] if c["path"].endswith("BudgetedFedAvg")]
    assert args["dp_delta"] == 1e-6
    assert args["site_privacy"]["site-2"] == {"filter": "gaussian", "clip_norm": 0.5, "noise_multiplier": 2.0}
    assert args["site_privacy"]["site-3"] == {"filter": "none"}
