"""Running the job on FLARE's real runtime on this machine: POC mode (`--env poc`).

FLARE's Recipe API `PocEnv` provisions a server, one client per site and an admin on loopback,
starts them as separate processes, and takes the job through the admin API (submit, monitor,
download). Two things a real deployment configures are set here for the rehearsal:
- every process runs this Python (its folder goes first on PATH, which FLARE's start scripts
  read for `python3`), so each one imports the installed package;
- each participant's `local/resources.json` allows this package's components
  (`class_allow_list`: FLARE's defaults plus `nvfp4_jax.federated.`). FLARE refuses a job's
  component from an installed package unless the site allows it; a real site's admin adds the
  same entry (docs/federated.md, "FLARE's real runtime").

FLARE's `PocEnv.deploy` submits the job a fixed 3 s after starting the processes, and the server
deploys it to whichever clients have connected by then (at least the job's `min_clients`): on a
loaded machine a site that connects later is left out of the whole job, silently. `run` submits
only once every site's client is connected (`wait_for_sites`), or fails naming the ones missing.

The server writes `federated.json` and `global_model.npz` to the job's output directory, as in
the simulator. FLARE's own logs (the server's and each site's) are copied to
`<output_dir>/poc_logs/` before the POC workspace is removed.

A site killed mid-job (kill -9 of its FLARE client and job process): with `--min-responses` the
rounds go on from the others, and the server runs all of them. FLARE then still ends the job
FINISHED:ABNORMAL (the site, started again by FLARE's start script, reports that it has no such
job). `run` takes that status as done when the server recorded every round, with one warning line.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import sys
import time

ALLOWED_PREFIX = "nvfp4_jax.federated."
SITES_CONNECT_TIMEOUT_S = 300.0  # how long the job waits for every site's client to connect
COMPLETED = "FINISHED:COMPLETED"
ABNORMAL = "FINISHED:ABNORMAL"  # FLARE's status when a participant lost its job (a killed site)


class PocError(RuntimeError):
    """The POC job did not complete; the message names its status and where its logs are."""


def allow_package(workspace: str) -> list[str]:
    """Adds this package to `class_allow_list` in every participant's `local/resources.json`
    under the POC `workspace` (created from FLARE's `resources.json.default`); returns the files."""
    # optional dependency (NVFLARE)
    from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

    written = []
    for default in sorted(glob.glob(os.path.join(workspace, "*", "prod_*", "*", "local", "resources.json.default"))):
        path = default[: -len(".default")]
        with open(path if os.path.exists(path) else default) as f:
            resources = json.load(f)
        allowed = list(resources.get("class_allow_list", DEFAULT_CLASS_ALLOW_LIST))
        if ALLOWED_PREFIX not in allowed:
            allowed.append(ALLOWED_PREFIX)
        resources["class_allow_list"] = allowed
        with open(path + ".tmp", "w") as f:
            json.dump(resources, f, indent=2)
        os.replace(path + ".tmp", path)
        written.append(path)
    return written


def wait_for_sites(session, site_names: list[str], timeout_s: float = SITES_CONNECT_TIMEOUT_S,
                   poll_s: float = 1.0) -> None:
    """Returns once every name in `site_names` is a client connected to the server of the FLARE
    admin `session` (`get_system_info`); raises PocError naming the missing ones after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        connected = {client.name for client in session.get_system_info().client_info}
        missing = [name for name in site_names if name not in connected]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise PocError(f"site(s) {', '.join(missing)} did not connect to the POC server within "
                           f"{timeout_s:.0f} s (connected: {', '.join(sorted(connected)) or 'none'})")
        time.sleep(poll_s)


def run(job, site_names: list[str], workspace: str, output_dir: str, timeout: float = 0.0, rounds: int = 0) -> str:
    """Runs `job` (a FLARE `FedJob`) in a fresh POC deployment under `workspace` with one client
    per name in `site_names`; returns the job's final status. Raises PocError unless it completed,
    or ended FINISHED:ABNORMAL after the server recorded all `rounds` (a site that died mid-job)."""
    # optional dependency (NVFLARE)
    import nvflare.recipe.poc_env as poc_env
    from nvflare.fuel.flare_api.flare_api import new_secure_session
    from nvflare.recipe.session_mgr import SessionManager

    os.environ["NVFLARE_POC_WORKSPACE"] = os.path.abspath(workspace)
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    env = poc_env.PocEnv(num_clients=len(site_names), clients=list(site_names))  # its default num_clients is 2
    # PocEnv.deploy provisions and then starts the processes; the allow list goes in between.
    provision = poc_env.prepare_poc_provision

    def provision_and_allow(*args, **kwargs):
        result = provision(*args, **kwargs)
        allow_package(env.poc_workspace)
        return result

    # PocEnv.deploy submits through its SessionManager; the wait for every site goes first.
    submit = SessionManager.submit_job

    def submit_when_all_sites_connected(manager, job_):
        session = new_secure_session(**manager.session_params)
        try:
            wait_for_sites(session, list(site_names))
        finally:
            session.close()
        return submit(manager, job_)

    os.makedirs(output_dir, exist_ok=True)
    monitor_log = os.path.join(output_dir, "poc_monitor.log")
    status = None
    try:
        poc_env.prepare_poc_provision = provision_and_allow
        SessionManager.submit_job = submit_when_all_sites_connected
        with open(monitor_log, "w") as log, contextlib.redirect_stdout(log):  # the admin API's job dumps
            job_id = env.deploy(job)
            env.get_job_result(job_id, timeout=timeout)
            status = env.get_job_status(job_id)
    finally:
        poc_env.prepare_poc_provision = provision
        SessionManager.submit_job = submit
        _keep_logs(env.poc_workspace, os.path.join(output_dir, "poc_logs"))
        with open(monitor_log, "a") as log, contextlib.redirect_stdout(log):
            env.stop(clean_up=True)
    logs = os.path.join(output_dir, "poc_logs")
    if status == ABNORMAL and rounds and recorded_all_rounds(output_dir, rounds):
        print(f"warning: FLARE ended the POC job {status} (a site lost its job process) after the server "
              f"completed all {rounds} rounds from the sites left; FLARE's logs are in {logs}",
              file=sys.stderr, flush=True)
    elif status != COMPLETED:
        raise PocError(f"the POC job ended {status}; FLARE's logs are in {logs}")
    return status


def recorded_all_rounds(output_dir: str, rounds: int) -> bool:
    """Whether the server's `federated.json` in `output_dir` records round `rounds`, the job not
    ended early (every site failed in a round)."""
    try:
        with open(os.path.join(output_dir, "federated.json")) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    return record.get("ended_in_round") is None and any(r.get("round") == rounds for r in record.get("rounds", []))


def _keep_logs(workspace: str, destination: str) -> None:
    for log in glob.glob(os.path.join(workspace, "*", "prod_*", "*", "**", "log.txt"), recursive=True):
        participant = os.path.relpath(log, workspace).split(os.sep)[2:]
        target = os.path.join(destination, *participant)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(log, target)
