"""The FLARE job: `BudgetedFedAvg` on the server, this project's client script on every site.

`FederatedSpec` is everything the command line decides (config as data); `build_job` turns it into
a FLARE `FedJob` that runs in FLARE's simulator on one machine (`simulate`) or exports as a job
folder for a real deployment (`export`: POC mode or provisioned sites, see docs/federated.md).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil

from nvfp4_jax.federated import budget as budget_lib
from nvfp4_jax.federated import contract as contract_lib
from nvfp4_jax.federated import privacy as privacy_lib


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    name: str
    data_path: str = ""  # empty: the run config's own data
    slowdown: float = 1.0
    watts: float | None = None
    devices: int = 0
    device_offset: int = 0
    device_slowdown: tuple[float, ...] = ()  # experiments: each device's stretch (silo shares)
    crash_in_round: int = 0


@dataclasses.dataclass(frozen=True)
class FederatedSpec:
    run_config: dict  # the training config's layers merged (flat MaxText keys)
    sites: tuple[SiteSpec, ...]
    rounds: int
    policy: budget_lib.BudgetPolicy
    contract: contract_lib.UpdateContract
    privacy: str = "none"  # the job-wide filter, for every site not in site_privacy
    privacy_options: dict = dataclasses.field(default_factory=dict)
    site_privacy: dict = dataclasses.field(default_factory=dict)  # site -> {"filter": name, **options}
    dp_delta: float = 1e-5
    output_dir: str = ""
    min_responses: int = 0
    round_timeout: int = 0
    eval_batches: int = 2
    disk_offload: bool = False
    weighting: str = "data"
    stream_tensors: bool = False
    silo: budget_lib.SiloPolicy | None = None  # per-device shares inside a site (None: FSDP)
    name: str = "nvfp4_jax_fedavg"

    def privacy_of(self, site_name: str) -> dict:
        """The site's privacy policy, `{"filter": name, **options}`: its own, else the job's."""
        return self.site_privacy.get(site_name) or {"filter": self.privacy, **self.privacy_options}


def _client_script() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "client.py")


def _script_args(site: SiteSpec, silo=None) -> str:
    args = [f"--slowdown {site.slowdown}", f"--devices {site.devices}", f"--device-offset {site.device_offset}"]
    if silo is not None and silo.on:
        args.append(f"--silo-shares {silo.name} --silo-microbatch {silo.microbatch} --silo-ema {silo.ema} "
                    f"--silo-deadband {silo.deadband}")
    if site.device_slowdown:
        args.append(f"--device-slowdown {','.join(str(f) for f in site.device_slowdown)}")
    if site.data_path:
        args.append(f"--data-path {site.data_path}")
    if site.watts is not None:
        args.append(f"--watts {site.watts}")
    if site.crash_in_round:
        args.append(f"--crash-in-round {site.crash_in_round}")
    return " ".join(args)


def build_job(spec: FederatedSpec):
    # optional dependency (NVFLARE)
    from nvflare.fuel.utils.constants import FrameworkType
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import ScriptRunner

    from nvfp4_jax.federated.server import TRAIN_TASK, BudgetedFedAvg

    job = FedJob(name=spec.name, min_clients=spec.min_responses or len(spec.sites))
    # The server and the sites run the installed package: FLARE copies none of it into the job's
    # `custom` folders (a partial copy there would shadow the installed package).
    job.set_app_packages(["nvfp4_jax"])
    job.to_server(BudgetedFedAvg(
        run_config=spec.run_config,
        site_names=[s.name for s in spec.sites],
        num_rounds=spec.rounds,
        budget_policy=dataclasses.asdict(spec.policy),
        update_contract=dataclasses.asdict(spec.contract),
        output_dir=spec.output_dir,
        min_responses=spec.min_responses,
        round_timeout=spec.round_timeout,
        eval_batches=spec.eval_batches,
        enable_tensor_disk_offload=spec.disk_offload,
        site_privacy={s.name: spec.privacy_of(s.name) for s in spec.sites},
        dp_delta=spec.dp_delta,
        weighting=spec.weighting,
        eval_devices=max(s.devices for s in spec.sites),
    ))
    if spec.stream_tensors:
        # optional dependency (NVFLARE)
        from nvfp4_jax.federated.streaming import PatientTensorClientStreamer, PatientTensorServerStreamer

        job.to_server(PatientTensorServerStreamer(format="numpy"), id="tensor_server_streamer")
    for site in spec.sites:
        job.to(ScriptRunner(script=_client_script(), script_args=_script_args(site, spec.silo),
                            framework=FrameworkType.NUMPY), site.name)
        policy = dict(spec.privacy_of(site.name))
        # FLARE's per-site configuration: this filter goes to this site's config only
        result_filter = privacy_lib.make_filter(policy.pop("filter"), policy)
        if result_filter is not None:
            # optional dependency (NVFLARE)
            from nvflare.job_config.defs import FilterType

            # Named tasks, not FLARE's default ["*"]: FLARE 2.9's runner looks filters up by the
            # task's own name, so a "*" chain is configured and never applied.
            job.to(result_filter, site.name, filter_type=FilterType.TASK_RESULT, tasks=[TRAIN_TASK])
        if spec.stream_tensors:
            job.to(PatientTensorClientStreamer(format="numpy"), site.name, id="tensor_client_streamer")
    return job


def simulate(spec: FederatedSpec, workspace: str, log_config: str = "concise") -> None:
    build_job(spec).simulator_run(workspace, threads=len(spec.sites), log_config=log_config)


# An exported job's backbone (`--backbone`), as each participant finds it: relative to the
# working directory FLARE runs its processes in, the participant's workspace.
EXPORTED_BACKBONE = "nvfp4_jax_backbone"


def portable(spec: FederatedSpec) -> FederatedSpec:
    """The job as real sites run it: no path of the exporting machine. Each site reads its data
    path from its own site-local setting (`client.site_data_path`), the server writes to
    `output_dir` relative to its run directory (`server.server_output_dir`): the run's name, and
    a backbone the exporting machine wrote (`load_parameters_path`, absolute) is read from
    EXPORTED_BACKBONE in each participant's workspace."""
    run_config = {k: v for k, v in spec.run_config.items() if k != "base_output_directory"}
    if os.path.isabs(str(run_config.get("load_parameters_path") or "")):
        run_config["load_parameters_path"] = EXPORTED_BACKBONE
    return dataclasses.replace(
        spec, run_config=run_config, sites=tuple(dataclasses.replace(s, data_path="") for s in spec.sites),
        output_dir=os.path.basename(os.path.normpath(spec.output_dir)) if spec.output_dir else "")


def export(spec: FederatedSpec, directory: str) -> str:
    """Writes the job folder for real sites (`portable`). Its client configs name the site script
    by its name in the app's `custom` folder (where FLARE copies it), not by this machine's path.
    A backbone goes beside the job folder, `directory`/EXPORTED_BACKBONE, for the participants'
    admins to copy into their workspaces (it is not sent with the job: every site holds it)."""
    backbone = str(spec.run_config.get("load_parameters_path") or "")
    if os.path.isabs(backbone):
        target = os.path.join(directory, EXPORTED_BACKBONE)
        for stale in (target, target + ".partial"):
            if os.path.exists(stale):
                shutil.rmtree(stale)
        shutil.copytree(backbone, target + ".partial")
        os.replace(target + ".partial", target)  # never half a backbone under the final name
    spec = portable(spec)
    build_job(spec).export_job(directory)
    folder = os.path.join(directory, spec.name)
    for config in glob.glob(os.path.join(folder, "app_*", "config", "config_fed_client.json")):
        with open(config) as f:
            text = json.load(f)
        for executor in text.get("executors", []):
            args = executor.get("executor", {}).get("args", {})
            if "task_script_path" in args:
                args["task_script_path"] = os.path.basename(args["task_script_path"])
        with open(config, "w") as f:
            json.dump(text, f, indent=4)
    return folder
