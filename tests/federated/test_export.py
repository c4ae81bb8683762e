"""An exported job is portable: it names no path of the exporting machine, each site reads its
data from its own site-local setting, and the server writes inside its own run directory."""

import dataclasses
import json
import os
import sys

import pytest

pytest.importorskip("nvflare")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _export(tmp_path):
    from nvfp4_jax.federated import job as job_lib
    from nvfp4_jax.federated.__main__ import build_spec

    data = []
    for i in (1, 2):
        path = tmp_path / "data" / f"site-{i}-text.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text("to be or not to be " * 50)
        data += ["--site-data", str(path)]
    spec, _, _ = build_spec(["--sites", "2", *data, "--disk-offload", f"base_output_directory={tmp_path / 'out'}"])
    assert spec.output_dir.startswith(str(tmp_path))  # the simulator and POC keep their absolute one
    return spec, job_lib.export(spec, str(tmp_path / "jobs"))


def test_an_exported_job_names_no_absolute_path_of_the_exporting_machine(tmp_path):
    spec, where = _export(tmp_path)
    machine_paths = {str(tmp_path), ROOT, sys.prefix, sys.executable, os.path.expanduser("~"),
                     spec.output_dir, *(s.data_path for s in spec.sites)}
    machine_paths = {p for p in machine_paths if p and p != os.sep}
    files = [os.path.join(d, f) for d, _, names in os.walk(where) for f in names]
    assert any(f.endswith("config_fed_server.json") for f in files)
    for path in files:
        with open(path, errors="replace") as f:
            text = f.read()
        for machine_path in machine_paths:
            assert machine_path not in text, f"{os.path.relpath(path, where)} names {machine_path}"
    server = json.load(open(os.path.join(where, "app_server", "config", "config_fed_server.json")))
    (workflow,) = [w for w in server["workflows"] if w["path"].endswith("BudgetedFedAvg")]
    assert workflow["args"]["output_dir"] == "federated"  # the run's name, inside the server's run dir
    for site in spec.sites:
        client = json.load(open(os.path.join(where, f"app_{site.name}", "config", "config_fed_client.json")))
        (executor,) = client["executors"]
        assert "--data-path" not in executor["executor"]["args"]["task_script_args"]


def test_the_server_writes_a_relative_output_dir_inside_its_run_directory(tmp_path):
    from nvfp4_jax.federated.server import server_output_dir

    run_dir = str(tmp_path / "workspace" / "job-1")
    assert server_output_dir("federated", run_dir) == os.path.join(run_dir, "federated")
    assert server_output_dir(str(tmp_path / "abs"), run_dir) == str(tmp_path / "abs")  # simulator, POC
    assert server_output_dir("", run_dir) == ""


def test_a_site_reads_its_data_from_its_site_local_setting(tmp_path):
    from nvfp4_jax.federated.client import SITE_DATA_ENV, SITE_SETTINGS, site_data_path

    workspace = tmp_path / "site-1"
    (workspace / "local").mkdir(parents=True)
    by_env, by_file, by_job = (tmp_path / n for n in ("env.txt", "file.txt", "job.txt"))
    for path in (by_env, by_file, by_job):
        path.write_text("text")
    # Nothing set: the run config's own data.
    assert site_data_path("", {}, str(workspace)) == ("", "config")
    # The workspace's local/nvfp4_jax_site.json; a relative path is the workspace's.
    (workspace / SITE_SETTINGS).write_text(json.dumps({"data_path": "../file.txt"}))
    path, source = site_data_path("", {}, str(workspace))
    assert os.path.samefile(path, by_file) and source.endswith(SITE_SETTINGS)
    # The environment variable before the file; the job's own --data-path before both.
    assert site_data_path("", {SITE_DATA_ENV: str(by_env)}, str(workspace)) == (str(by_env), SITE_DATA_ENV)
    assert site_data_path(str(by_job), {SITE_DATA_ENV: str(by_env)}, str(workspace)) == (str(by_job), "--data-path")
    # A setting that names no file is an error naming where it came from.
    with pytest.raises(ValueError, match=SITE_DATA_ENV):
        site_data_path("", {SITE_DATA_ENV: str(tmp_path / "missing.txt")}, str(workspace))
    (workspace / SITE_SETTINGS).write_text(json.dumps({"data_path": "missing.txt"}))
    with pytest.raises(ValueError, match="nvfp4_jax_site.json"):
        site_data_path("", {}, str(workspace))


def test_an_exported_backbone_lies_beside_the_job_and_each_participant_reads_it_from_its_workspace(tmp_path):
    from nvfp4_jax.federated import job as job_lib

    spec, _ = _export(tmp_path)
    backbone = tmp_path / "out" / "federated" / "backbone"  # what --backbone writes before the job
    backbone.mkdir(parents=True)
    (backbone / "params.npz").write_bytes(b"weights")
    (backbone / "meta.json").write_text("{}")
    (tmp_path / "jobs" / f"{job_lib.EXPORTED_BACKBONE}.partial").mkdir(parents=True)  # an earlier crash's
    spec = dataclasses.replace(spec, run_config={**spec.run_config, "load_parameters_path": str(backbone)})
    where = job_lib.export(spec, str(tmp_path / "jobs"))
    copied = tmp_path / "jobs" / job_lib.EXPORTED_BACKBONE
    assert sorted(os.listdir(tmp_path / "jobs")) == sorted([spec.name, job_lib.EXPORTED_BACKBONE])
    assert (copied / "params.npz").read_bytes() == b"weights" and (copied / "meta.json").read_text() == "{}"
    configs = [os.path.join(d, f) for d, _, names in os.walk(where) for f in names if f.endswith(".json")]
    for path in configs:
        assert str(tmp_path) not in open(path).read(), path
    server = json.load(open(os.path.join(where, "app_server", "config", "config_fed_server.json")))
    (workflow,) = [w for w in server["workflows"] if w["path"].endswith("BudgetedFedAvg")]
    assert workflow["args"]["run_config"]["load_parameters_path"] == job_lib.EXPORTED_BACKBONE


def test_without_flare_the_command_is_one_error_line_not_a_traceback(monkeypatch, capsys):
    import importlib.util

    from nvfp4_jax.federated.__main__ import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nvflare" else find_spec(name, *a))
    assert main(["--sites", "2"]) == 2
    err = capsys.readouterr().err
    assert err == "error: federated training needs NVIDIA FLARE: pip install 'nvfp4_jax[federated]'\n"


def test_every_sites_privacy_filter_is_found_for_the_task_the_server_sends(tmp_path):
    """FLARE 2.9's client runner looks its result filters up by the task's own name
    (`task_utils.get_filters`): a chain for FLARE's default task list `["*"]` is written into the
    job and never applied (the sites sent unclipped, unnoised updates while epsilon was reported).
    Each site's configured chain, resolved as the runtime resolves it, gives its filter for the
    round's task."""
    from nvflare.apis.fl_constant import FilterKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.utils.task_utils import get_filters
    from nvflare.private.fed_json_config import FedJsonConfigurator, FilterChain

    from nvfp4_jax.federated import job as job_lib
    from nvfp4_jax.federated.__main__ import build_spec
    from nvfp4_jax.federated.server import TRAIN_TASK

    spec, _, _ = build_spec(["--sites", "2", "--privacy", "gaussian", "--noise-multiplier", "1",
                             "--site-privacy", "site-2=svt", f"base_output_directory={tmp_path / 'out'}"])
    where = job_lib.export(spec, str(tmp_path / "jobs"))
    want = {"site-1": "nvfp4_jax.federated.privacy.GaussianPrivacy", "site-2": "nvflare.app_common.filters.svt_privacy.SVTPrivacy"}
    for site, path in want.items():
        (config,) = [os.path.join(d, f) for d, _, files in os.walk(where) for f in files
                     if f == "config_fed_client.json" and f"app_{site}" in d]
        with open(config) as f:
            chains = json.load(f)["task_result_filters"]
        table = {}
        for c in chains:
            chain = FilterChain("task_result_filters", FilterKey.OUT)
            chain.tasks, chain.filters = c["tasks"], [fl["path"] for fl in c["filters"]]
            FedJsonConfigurator._build_filter_table(None, chain, table)
        assert get_filters("task_result_filters", FLContext(), table, TRAIN_TASK, FilterKey.OUT) == [path], site
