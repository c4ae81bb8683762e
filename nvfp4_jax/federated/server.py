"""The server side: FedAvg (FLARE's controller) with per-site sample budgets and a global evaluation.

`BudgetedFedAvg` is FLARE's `FedAvg` (a weighted mean of the sites' updates, each weighted by its
`NUM_STEPS_CURRENT_ROUND`) with these additions, each in one override:
- `send_model`: every round's task carries the run's training config, the update contract and
  each site's sample budget (the `budget` policy, from the sites' measured costs);
- `_aggregate_one_result`: a site's report (seconds, samples, joules, bytes) feeds the cost
  model, a compressed update is decoded before FedAvg averages it, and its weight is set by
  `weighting` (`data`, FedAvg's definition: the site's training tokens; `samples`: the samples it
  trained this round, which under adaptive budgets leans toward the fast sites); an empty or
  non-finite result (a site that failed) is left out of the average, never mixed into it;
- `--disk-offload` (`enable_tensor_disk_offload`): the running weighted sum lives in
  memory-mapped files (`disk_aggregation.DiskWeightedAggregator`, FedAvg's `aggregator`) in a
  directory under `<output_dir>/.aggregation` that exists only during a round, not in the
  server's memory; FLARE's own tensor disk offload is passed on too (it applies only to streamed
  PyTorch tensors, and this project sends NumPy). `federated.json` records `aggregation`
  (`disk` or `memory`) and each round's `aggregation_disk_bytes`;
- `update_model`: the new global model is evaluated on the held-out set (a VLM: its validation
  loss and held-out `vqa_accuracy` beside `vqa_chance`), each site's privacy
  spending is accounted (`accounting.py`), the round is printed and recorded in
  `<output_dir>/federated.json`. A round in which every site failed leaves the global model as
  it was (FLARE's mean of nothing is an empty model) and ends the job: the later rounds send
  nothing, and `ended_in_round` says where it stopped.
The initial global model is the project's own initialisation (`seed`), made on the server, or
the parameters `load_parameters_path` names (`--backbone`, `backbone.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import numpy as np
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.workflows.fedavg import FedAvg

from nvfp4_jax.federated import accounting
from nvfp4_jax.federated import budget as budget_lib
from nvfp4_jax.federated import contract as contract_lib
from nvfp4_jax.federated.disk_aggregation import DiskWeightedAggregator

TRAIN_TASK = "train"  # the task every round sends the sites (FLARE's FedAvg names it so)

META_KEY = "nvfp4_jax"


def server_output_dir(output_dir: str, run_dir: str) -> str:
    """Where the server writes: an absolute `output_dir` (the simulator, POC mode) as it is; a
    relative one (an exported job) inside the server's run directory for the job, whose contents
    come back with the job (`nvflare job download`); empty: nowhere."""
    if not output_dir or os.path.isabs(output_dir):
        return output_dir
    return os.path.join(run_dir, output_dir)


def _site_name(result: FLModel) -> str:
    meta = result.meta or {}
    return str(meta.get("client_name") or meta.get(FLMetaKey.CLIENT_NAME, "?"))


class BudgetedFedAvg(FedAvg):
    def __init__(
        self,
        *,
        run_config: dict,
        site_names: list,
        num_rounds: int = 2,
        budget_policy: dict | None = None,
        update_contract: dict | None = None,
        output_dir: str = "",
        min_responses: int = 0,
        round_timeout: int = 0,
        eval_batches: int = 2,
        enable_tensor_disk_offload: bool = False,
        site_privacy: dict | None = None,
        dp_delta: float = 1e-5,
        weighting: str = "data",
        eval_devices: int = 0,
    ):
        aggregator = None
        if enable_tensor_disk_offload:
            aggregator = DiskWeightedAggregator(root=os.path.join(output_dir, ".aggregation") if output_dir else "")
        super().__init__(num_clients=len(site_names), num_rounds=num_rounds, persistor_id="",
                         aggregator=aggregator, enable_tensor_disk_offload=enable_tensor_disk_offload)
        self.run_config = run_config
        self.site_names = list(site_names)
        self.budget_policy = dict(budget_policy or {})
        self.update_contract = dict(update_contract or {})
        self.output_dir = output_dir
        self.min_responses = min_responses
        self.round_timeout = round_timeout
        self.eval_batches = eval_batches
        self.eval_devices = eval_devices
        self.site_privacy = dict(site_privacy or {})  # site -> {"filter": name, **options}
        self.dp_delta = dp_delta
        if weighting not in contract_lib.WEIGHTINGS:
            raise ValueError(f"weighting={weighting!r} is not one of {', '.join(contract_lib.WEIGHTINGS)}")
        self.weighting = weighting
        self.ended_in_round: int | None = None  # the round in which every site failed
        self._policy = budget_lib.policy_from_dict(self.budget_policy)
        self._contract = contract_lib.UpdateContract(**self.update_contract)
        self._costs = {s: budget_lib.SiteCost() for s in self.site_names}
        self._budgets: list[int] | None = None
        self._reports: dict[str, dict] = {}
        self._history: list[dict] = []
        self._evaluator = None
        self._round_start = 0.0
        self._values_sent: dict[str, int] = {}
        self._privacy: dict[str, dict] = {}  # each site's newest privacy record
        self._downlink_bytes = 0  # what each site received in the current round

    # --- the global model ---------------------------------------------------------------

    def _eval(self):
        if self._evaluator is None:
            # the evaluator (jax, the model) loads only when the server evaluates
            from nvfp4_jax.config import make_config
            from nvfp4_jax.federated.site import Evaluator

            import jax

            # As many devices as the largest site trains on (the model divides over that many),
            # or all of them (0).
            devices = jax.devices()[:self.eval_devices] if self.eval_devices else None
            self._evaluator = Evaluator(make_config(self.run_config), devices=devices, num_batches=self.eval_batches)
        return self._evaluator

    def load_model(self) -> FLModel:
        params = self._eval().initial_params()
        self._emit({"round": 0, **self._eval().scores(params), "budgets": None})
        return FLModel(params=params, params_type=ParamsType.FULL)

    def _save_model(self, model: FLModel) -> None:
        if not self.output_dir:
            return
        path = os.path.join(self.output_dir, "global_model.npz")
        tmp = path + ".tmp.npz"
        np.savez(tmp, **{k: np.asarray(v) for k, v in model.params.items()})
        os.replace(tmp, path)  # a crash mid-save leaves the previous round's model intact

    def run(self) -> None:
        if self.output_dir and not os.path.isabs(self.output_dir):
            self.output_dir = server_output_dir(self.output_dir, self.get_run_dir())
            if self.aggregator is not None:
                self.aggregator.root = os.path.join(self.output_dir, ".aggregation")
        try:
            super().run()
        finally:
            if self.aggregator is not None:
                self.aggregator.reset_stats()  # an aborted round leaves no files behind

    # --- one round ------------------------------------------------------------------------

    def send_model(self, task_name=TRAIN_TASK, data: FLModel = None, targets=None, min_responses=None,
                   timeout=0, callback=None):
        round_index = len(self._history) - 1  # 0-based: the history starts with the initial model
        costs = [self._costs[s] for s in self.site_names]
        self._budgets = budget_lib.allocate(self._policy, costs, self._budgets, round_index)
        data.meta = dict(data.meta or {})
        data.meta[META_KEY] = {
            "config": self.run_config,
            "contract": self.update_contract,
            "budgets": budget_lib.by_site(self.site_names, self._budgets),
            "round": round_index + 1,
            "schedule_window": self._schedule_window(round_index),
        }
        self._reports = {}
        self._values_sent = {}
        self._round_start = time.perf_counter()
        if self.ended_in_round is not None:
            return None  # every site failed in an earlier round: the job ends without training
        sent = self._sent_model(data)
        self._downlink_bytes = contract_lib.payload_bytes(sent.params)
        return super().send_model(
            task_name=task_name, data=sent, targets=targets,
            min_responses=self.min_responses or None, timeout=self.round_timeout, callback=callback)

    def _sent_model(self, model: FLModel) -> FLModel:
        """What a site receives: the global model, or under a frozen backbone (`subset`,
        `adapters`) only its trained leaves (the sites hold the same backbone). A new FLModel:
        the global model itself keeps every leaf."""
        if not self._contract.frozen_backbone:
            return model
        from nvfp4_jax.config import make_config  # jax-free: the layer count `last:N` counts from

        layers = make_config(self.run_config).model.base_num_decoder_layers
        keep = contract_lib.trainable_paths(self._contract, list(model.params), layers)
        return FLModel(params={k: model.params[k] for k in keep}, params_type=model.params_type,
                       meta=model.meta, current_round=model.current_round, total_rounds=model.total_rounds)

    def _schedule_window(self, round_index: int) -> list[int] | None:
        """The round's window of the learning-rate schedule in global steps: the local steps a
        site with the nominal (equal) share of the round's samples takes, `[r * n, (r + 1) * n)`
        (the schedule's `steps` spans all rounds of them; `site.schedule_positions`). None when
        the policy names no round total (the sites then count their own steps)."""
        if not self._policy.total_samples:
            return None
        nominal = max(1, self._policy.total_samples // (len(self.site_names) * self._policy.quantum))
        return [round_index * nominal, (round_index + 1) * nominal]

    def _aggregate_one_result(self, result: FLModel) -> bool:
        site = _site_name(result)
        meta = result.meta or {}
        report = meta.get(META_KEY)
        if not result.params or not isinstance(report, dict):
            self._reports[site] = {"failed": True, **({"error": report["error"]} if isinstance(report, dict)
                                                      and "error" in report else {})}
            self.warning(f"site {site} returned no update this round; it is left out of the average")
            return False
        if self._contract.compression != "none":
            result.params = contract_lib.decode(result.params, self._contract.compression, report["shapes"])
        if not contract_lib.all_finite(result.params):
            # Checked on the server too: a site's own check cannot be relied on.
            self._reports[site] = {"failed": True, "error": "non-finite update (NaN or Inf)"}
            self.warning(f"site {site} sent a non-finite update this round; it is left out of the average")
            return False
        self._values_sent[site] = sum(int(np.size(v)) for v in result.params.values())
        self._reports[site] = {k: report.get(k) for k in
                               ("samples", "steps", "seconds", "joules", "energy_source", "payload_bytes", "train_loss",
                                "data_tokens")}
        if isinstance(report.get("silo"), dict):  # per-device shares inside the site (silo.py)
            self._reports[site]["silo"] = report["silo"]
        weight = self._weight(report)
        self._reports[site]["weight"] = weight
        result.meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND] = weight  # what FedAvg weights the update by
        if site in self._costs:
            self._costs[site] = budget_lib.smooth(self._costs[site], float(report["seconds"]),
                                                  int(report["samples"]), report.get("joules"),
                                                  self._policy.ema)
        return super()._aggregate_one_result(result)

    def _weight(self, report: dict) -> float:
        """The site's FedAvg weight. A site whose data has no size (synthetic data) counts 1."""
        if self.weighting == "samples":
            return float(report["samples"])
        return float(report.get("data_tokens") or 1)

    def update_model(self, model, aggr_result):
        if self.ended_in_round is not None:
            return model
        if not any(not r.get("failed") for r in self._reports.values()):
            return self._end_job(model)
        model = super().update_model(model, aggr_result)
        for site in self.site_names:  # no result by the time the round closed (min_responses / timeout)
            self._reports.setdefault(site, {"failed": True})
        # The round's makespan is its measured wall time, from the broadcast to the aggregated
        # model (FLARE's dispatch and polling included, the server's evaluation not); beside it,
        # the slowest site's own busy time.
        makespan = time.perf_counter() - self._round_start
        seconds = [r["seconds"] for r in self._reports.values() if not r.get("failed")]
        record = {
            "round": len(self._history),
            **self._eval().scores(model.params),  # validation_loss (a VLM: and vqa_accuracy, vqa_chance)
            "budgets": budget_lib.by_site(self.site_names, self._budgets or []),
            "sites": self._reports,
            "makespan_s": makespan,
            "compute_makespan_s": max(seconds) if seconds else 0.0,
            # Each site's wait at the round's barrier: the round's wall time less its own busy time.
            "idle_s": {s: makespan - r["seconds"] for s, r in self._reports.items() if not r.get("failed")},
            "compute_cv": (statistics.pstdev(seconds) / statistics.mean(seconds)
                           if len(seconds) > 1 and statistics.mean(seconds) > 0 else 0.0),
            "bytes_sent": sum(int(r.get("payload_bytes") or 0) for r in self._reports.values()),
            # What each site received this round, and what full-model FedAvg moves each way per site.
            "downlink_bytes_per_site": self._downlink_bytes,
            "full_model_bytes": contract_lib.payload_bytes(model.params),
        }
        if self.aggregator is not None:
            record["aggregation_disk_bytes"] = self.aggregator.last_round_bytes  # the running sum's files
        if any(p.get("filter", "none") != "none" for p in self.site_privacy.values()):
            record["privacy"] = self._account(model)
        self._emit(record)
        return model

    def _end_job(self, model):
        """Every site failed this round: the global model stays the last good one, and the job ends."""
        round_index = len(self._history)
        for site in self.site_names:
            self._reports.setdefault(site, {"failed": True})
        self.ended_in_round = round_index
        saved = os.path.join(self.output_dir, "global_model.npz") if self.output_dir else "not saved (no output_dir)"
        message = (f"every site failed in round {round_index}; the job ends, and the last good global model "
                   f"is round {round_index - 1}'s: {saved}")
        self._emit({"round": round_index, "validation_loss": self._history[-1]["validation_loss"],
                    "budgets": budget_lib.by_site(self.site_names, self._budgets or []), "sites": self._reports,
                    "makespan_s": time.perf_counter() - self._round_start, "compute_makespan_s": 0.0,
                    "idle_s": {}, "compute_cv": 0.0, "bytes_sent": 0, "ended": message})
        self.error(message)
        self._save_model(model)
        return model

    def save_model(self, model: FLModel) -> None:
        if self.ended_in_round is None:  # else `_end_job` has saved the last good model
            self._save_model(model)

    def _account(self, model) -> dict:
        """Every site's privacy record after this round; a site that sent nothing is charged as
        if it had sent all it could have (an upper bound): the whole model, or under a frozen
        backbone (`subset`, `adapters`) the trained leaves, which alone ever leave a site."""
        most = self._sent_model(model).params  # what a site receives is what it can send back
        model_values = sum(int(np.size(v)) for v in most.values())
        self._privacy = {
            site: accounting.account_round(self.site_privacy.get(site, {"filter": "none"}), self.dp_delta,
                                           self._privacy.get(site), self._values_sent.get(site, model_values))
            for site in self.site_names}
        return self._privacy

    def _emit(self, record: dict) -> None:
        self._history.append(record)
        print(f"[federated] {round_line(record, self.num_rounds)}", flush=True)
        if self.output_dir:
            os.makedirs(self.output_dir, exist_ok=True)
            path = os.path.join(self.output_dir, "federated.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"policy": dataclasses.asdict(self._policy), "contract": self.update_contract,
                           "weighting": self.weighting, "ended_in_round": self.ended_in_round,
                           "aggregation": "memory" if self.aggregator is None else "disk",
                           "privacy": {"delta": self.dp_delta, "sites": self.site_privacy},
                           "rounds": self._history}, f, indent=1, default=float)
            os.replace(path + ".tmp", path)


def round_line(record: dict, num_rounds: int) -> str:
    """A round's line: the global validation loss, then (after round 0) the budgets, the makespan,
    the bytes sent, a silo's per-device shares, the sites that sent nothing, the privacy spent, and an end of the job."""
    line = f"round {record['round']}/{num_rounds}: global validation loss {record['validation_loss']:.4f}"
    if "vqa_accuracy" in record:
        line += f", held-out VQA {record['vqa_accuracy']:.3f} (chance {record['vqa_chance']:.3f})"
    if record.get("budgets"):
        line += " | samples " + " ".join(f"{s}={b}" for s, b in record["budgets"].items())
        line += (f" | makespan {record['makespan_s']:.2f} s (compute {record.get('compute_makespan_s', 0.0):.2f} s)"
                 f" | sent {record['bytes_sent'] / 1e6:.3f} MB")
        senders = sum(1 for r in (record.get("sites") or {}).values() if not r.get("failed"))
        if record.get("full_model_bytes") and senders:  # what the same sites' full models would be
            line += f" ({100 * record['bytes_sent'] / (senders * record['full_model_bytes']):.1f}% of full models)"
        silos = {s: r["silo"]["trained_with"] for s, r in (record.get("sites") or {}).items() if r.get("silo")}
        if silos:  # per-device shares inside a silo: the microbatches each device trained a step
            line += " | devices " + " ".join(f"{s}={':'.join(map(str, k))}" for s, k in silos.items())
    if record.get("sites"):
        failed = [s for s, r in record["sites"].items() if r.get("failed")]
        if failed:
            line += f" | no update from {', '.join(failed)}"
    spent = accounting.summary(record.get("privacy") or {})
    if spent:
        line += f" | {spent}"
    if record.get("ended"):
        line += " | every site failed: the job ends"
    return line
