"""FLARE's real runtime: the job in POC mode (a server and a client process per site on loopback,
through the admin API) against the simulator, and the exported job folder's portability."""

import json
import os

import pytest

from test_simulator import _run

pytest.importorskip("nvflare")

# Equal budgets: the adaptive split follows measured times, which differ between two runs.
ARGS = ("--sites", "2", "--rounds", "2", "--budget", "equal")


@pytest.mark.slow
def test_poc_mode_runs_the_job_as_the_simulator_does(tmp_path):
    (tmp_path / "poc").mkdir()
    (tmp_path / "sim").mkdir()
    poc_out, poc = _run(tmp_path / "poc", *ARGS, "--env", "poc")
    sim_out, sim = _run(tmp_path / "sim", *ARGS)
    assert [r["budgets"] for r in poc["rounds"]] == [r["budgets"] for r in sim["rounds"]]
    poc_losses = [r["validation_loss"] for r in poc["rounds"]]
    sim_losses = [r["validation_loss"] for r in sim["rounds"]]
    # The same code on the same seed; only the order in which results arrive may differ (the
    # fp32 weighted sum of two updates). Measured: equal to 4 decimals.
    assert poc_losses == pytest.approx(sim_losses, abs=1e-4)
    assert poc_losses[-1] < poc_losses[0] - 0.5  # it trained
    # The round lines are the simulator's, read back from the server's record.
    assert [line for line in poc_out.splitlines() if line.startswith("[federated] round 2/2")]
    # The processes' own logs are kept; the POC workspace is gone.
    logs = tmp_path / "poc" / "federated" / "poc_logs"
    assert (logs / "server" / "log.txt").exists() and (logs / "site-2" / "log.txt").exists()


def test_the_allow_list_lets_this_package_run_and_keeps_flare_s_defaults(tmp_path):
    from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

    from nvfp4_jax.federated import poc

    for participant in ("server", "site-1"):
        local = tmp_path / "example_project" / "prod_00" / participant / "local"
        local.mkdir(parents=True)
        (local / "resources.json.default").write_text(json.dumps(
            {"format_version": 2, "class_allow_list": list(DEFAULT_CLASS_ALLOW_LIST)}))
    written = poc.allow_package(str(tmp_path))
    assert len(written) == 2
    for path in written:
        allowed = json.load(open(path))["class_allow_list"]
        assert allowed == [*DEFAULT_CLASS_ALLOW_LIST, "nvfp4_jax.federated."]
    assert poc.allow_package(str(tmp_path)) == written  # idempotent
    assert json.load(open(written[0]))["class_allow_list"].count("nvfp4_jax.federated.") == 1


def test_an_exported_job_names_no_path_of_this_machine_for_code(tmp_path):
    from nvfp4_jax.federated import job as job_lib
    from nvfp4_jax.federated.__main__ import build_spec

    spec, _, _ = build_spec(["--sites", "2", f"base_output_directory={tmp_path}"])
    where = job_lib.export(spec, str(tmp_path / "jobs"))
    # The server and the sites import the installed package: no copy of it in the job.
    copied = [os.path.join(d, f) for d, _, files in os.walk(where) for f in files if f.endswith(".py")]
    # Only the site script, which FLARE copies into each site's custom/ (it runs from there).
    assert sorted(os.path.relpath(p, where).split(os.sep)[0] for p in copied) == ["app_site-1", "app_site-2"]
    assert all(os.path.basename(p) == "client.py" and os.sep + "custom" + os.sep in p for p in copied)
    assert not os.path.exists(os.path.join(where, "app_server", "custom"))
    for site in spec.sites:
        config = json.load(open(os.path.join(where, f"app_{site.name}", "config", "config_fed_client.json")))
        (executor,) = config["executors"]
        assert executor["executor"]["args"]["task_script_path"] == "client.py"  # found in the app's custom/


def _site_processes(site: str, under: str) -> list[int]:
    """The pids of FLARE's processes for `site` (its client and its job process) whose command
    line names a path under `under` (this test's POC workspace, never another run's)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        line = " ".join(argv)
        if "nvflare.private.fed.app.client" in line and under in line and site in line:
            pids.append(int(pid))
    return pids


@pytest.mark.slow
def test_a_site_killed_mid_job_leaves_the_job_to_the_others(tmp_path):
    """kill -9 of a whole site (its FLARE client and its job process) after round 1: with
    --min-responses 2 the rounds complete from the two that are left, federated.json records the
    dead site as failed in every round after the kill, and the command succeeds (FLARE's own
    status for the job may be FINISHED:ABNORMAL: poc.run accepts it once every round is recorded)."""
    if not os.path.isdir("/proc"):
        pytest.skip("finds the site's processes in /proc")
    import signal
    import subprocess
    import sys
    import time

    from test_simulator import ROOT, SMALL

    out = tmp_path / "federated"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nvfp4_jax.federated", "--sites", "3", "--rounds", "3", "--budget", "equal",
         "--min-responses", "2", "--round-timeout", "120", "--env", "poc", *SMALL, f"base_output_directory={tmp_path}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": ROOT})
    killed, deadline = [], time.monotonic() + 600
    try:
        while not killed and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            rounds = [] if not (out / "federated.json").exists() else json.load(open(out / "federated.json"))["rounds"]
            if len(rounds) >= 2:  # round 1 is recorded: kill site-3 as it trains round 2
                killed = _site_processes("site-3", str(out / "flare_workspace"))
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(killed) == 2, output[-3000:]  # the site's client and its job process
    assert proc.returncode == 0, output[-3000:]
    rounds = json.load(open(out / "federated.json"))["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    # Round 1 (all three alive) closes once --min-responses 2 have answered: a third answer may or
    # may not make it in time. After the kill exactly the two that are left answer.
    assert sum(not s.get("failed") for s in rounds[1]["sites"].values()) >= 2
    for record in rounds[2:]:
        assert sum(not s.get("failed") for s in record["sites"].values()) == 2
        assert record["sites"]["site-3"] == {"failed": True}
    assert rounds[-1]["validation_loss"] < rounds[0]["validation_loss"]
    assert "no update from site-3" in output


def test_all_rounds_are_recorded_only_when_the_last_round_is_and_the_job_did_not_end(tmp_path):
    from nvfp4_jax.federated.poc import recorded_all_rounds

    assert not recorded_all_rounds(str(tmp_path), 2)  # no federated.json
    record = {"ended_in_round": None, "rounds": [{"round": 0}, {"round": 1}]}
    (tmp_path / "federated.json").write_text(json.dumps(record))
    assert not recorded_all_rounds(str(tmp_path), 2)
    record["rounds"].append({"round": 2})
    (tmp_path / "federated.json").write_text(json.dumps(record))
    assert recorded_all_rounds(str(tmp_path), 2)
    record["ended_in_round"] = 1  # every site failed in round 1: the later rounds sent nothing
    (tmp_path / "federated.json").write_text(json.dumps(record))
    assert not recorded_all_rounds(str(tmp_path), 2)


class _Session:
    """A FLARE admin session whose server sees the clients of `connected[i]` at the i-th poll."""

    def __init__(self, connected):
        self.connected, self.polls, self.closed = list(connected), 0, False

    def get_system_info(self):
        from types import SimpleNamespace

        names = self.connected[min(self.polls, len(self.connected) - 1)]
        self.polls += 1
        return SimpleNamespace(client_info=[SimpleNamespace(name=n) for n in names])

    def close(self):
        self.closed = True


SITES = ["site-1", "site-2", "site-3"]


def test_waiting_for_sites_returns_once_all_are_connected_and_names_the_missing_ones():
    from nvfp4_jax.federated.poc import PocError, wait_for_sites

    late = _Session([["site-2"], ["site-2", "site-3"], SITES])
    wait_for_sites(late, SITES, poll_s=0)
    assert late.polls == 3
    with pytest.raises(PocError, match=r"site\(s\) site-1 did not connect to the POC server within 0 s "
                                       r"\(connected: site-2, site-3\)"):
        wait_for_sites(_Session([["site-3", "site-2"]]), SITES, timeout_s=0.05, poll_s=0.01)


def test_the_poc_job_is_submitted_only_once_every_site_is_connected(tmp_path, monkeypatch):
    # FLARE's PocEnv.deploy submits 3 s after starting the processes and the server deploys the job
    # to the clients connected by then: a site that connects later would sit out the whole job.
    import nvflare.fuel.flare_api.flare_api as flare_api
    import nvflare.recipe.poc_env as poc_env
    from nvflare.recipe.session_mgr import SessionManager

    from nvfp4_jax.federated import poc

    session = _Session([["site-2", "site-3"], ["site-2", "site-3"], SITES])
    monkeypatch.setattr(flare_api, "new_secure_session", lambda **params: session)
    monkeypatch.setattr(poc.time, "sleep", lambda s: None)
    submitted = []

    def flare_submit(manager, job):
        submitted.append(session.polls)
        return "job-1"

    monkeypatch.setattr(SessionManager, "submit_job", flare_submit)

    class FakePocEnv:
        def __init__(self, num_clients, clients):
            self.poc_workspace = str(tmp_path / "poc")

        def deploy(self, job):  # as PocEnv.deploy: processes started, then submitted
            return SessionManager({"username": "admin"}).submit_job(job)

        def get_job_result(self, job_id, timeout=0.0):
            return None

        def get_job_status(self, job_id):
            return poc.COMPLETED

        def stop(self, clean_up=False):
            pass

    monkeypatch.setattr(poc_env, "PocEnv", FakePocEnv)
    assert poc.run(object(), SITES, str(tmp_path / "poc"), str(tmp_path / "out")) == poc.COMPLETED
    assert submitted == [3] and session.closed  # after the third poll, the first to see all three
    assert SessionManager.submit_job is flare_submit  # FLARE's own method is back
