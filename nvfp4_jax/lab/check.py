"""Regenerating a study's numbers: `--check` re-runs one of its runs and says whether it
reproduces bit for bit; `--analyze` recomputes the statistics of an existing results.json.

`--check` first compares the run's recorded resolved config with what this code resolves from the
study's own command (base args and arm spec): a default that changed since, or a hand-edited
results file, is a difference, reported before anything trains.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any, Callable

from nvfp4_jax.config import config_layers, from_dict, to_dict
from nvfp4_jax.lab import analysis, provenance, runs
from nvfp4_jax.lab.arms import arm_config, parse_arm

# What must come out identical for a run to count as reproduced.
COMPARED = ("loss_curve", "eval_losses", "eval_losses_bf16", "final_eval_loss", "final_eval_loss_bf16")


def load_results(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            results = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise runs.LabError(f"cannot read {path}: {exc}") from None
    if not isinstance(results, dict) or "study" not in results or "runs" not in results:
        raise runs.LabError(f"{path} is not a lab results.json (no study/runs).")
    return results


def _find_run(results: dict, which: str | None) -> dict:
    done = [r for r in results["runs"] if r.get("final_eval_loss") is not None]
    if not done:
        raise runs.LabError("the results hold no finished run to check.")
    if which is None:
        return done[0]
    for r in done:
        if os.path.basename(r["run_directory"]) == which or f"{r['arm']}-seed{r['seed']}" == which:
            return r
    names = ", ".join(sorted(os.path.basename(r["run_directory"]) for r in done))
    raise runs.LabError(f"--run {which!r}: no finished run of that name; choose one of {names}.")


def config_check(results: dict, record: dict) -> tuple[Any, list[str]]:
    """(the run's recorded config, differences between it and what the study's command resolves
    to with this code)."""
    study = results["study"]
    name = os.path.basename(record["run_directory"])
    saved = (study.get("configs") or {}).get(name)
    if saved is None:
        raise runs.LabError(f"results.json records no resolved config for {name} (written before "
                            "provenance was recorded): it cannot be checked.")
    spec = next((a["spec"] for a in study["arms"] if a["name"] == record["arm"]), record["arm"])
    wanted = arm_config(config_layers(study["base_args"]), parse_arm(spec), record["seed"],
                        saved["train"]["base_output_directory"])
    recorded = from_dict(saved)
    return recorded, runs.config_changes(to_dict(recorded), wanted)


def check(path: str, *, which: str | None = None, devices=None, log: Callable[[str], None] = print) -> bool:
    """Re-runs one run of the study at `path` in a fresh directory; True when it reproduces its
    recorded curve and final losses bit for bit. A changed config returns False before training."""
    results = load_results(path)
    record = _find_run(results, which)
    recorded, diffs = config_check(results, record)
    name = os.path.basename(record["run_directory"])
    if diffs:
        log(f"[check] {name}: the recorded config is not what this code resolves from the study's command: "
            + "; ".join(diffs) + ". Not reproducible as recorded.")
        return False
    prov = results["study"].get("provenance") or {}
    now = provenance.commit()
    if prov.get("commit") != now["commit"] or now["dirty"]:
        log(f"[check] note: the study was made at {prov.get('commit')}{' (dirty)' if prov.get('dirty') else ''}, "
            f"this is {now['commit']}{' (dirty)' if now['dirty'] else ''}.")
    recorded_devices = (prov.get("device") or {}).get("count")
    if devices is None and recorded_devices:
        # the lab reads and compares runs without jax; only a re-run needs it
        import jax

        if jax.device_count() != recorded_devices:
            log(f"[check] note: the study ran on {recorded_devices} device(s), this process has "
                f"{jax.device_count()}; a different mesh changes the sums' order, so expect differences.")
    window = results["study"].get("curve_window", 10)
    with tempfile.TemporaryDirectory(prefix="nvfp4_lab_check_") as tmp:
        cfg = from_dict({**to_dict(recorded), "train": {**to_dict(recorded)["train"], "base_output_directory": tmp}})
        log(f"[check] re-running {name} ({cfg.train.steps} steps) in {tmp}")
        runs.train_or_reuse(cfg, os.path.join(tmp, cfg.train.run_name), devices=devices)
        fresh = runs.read_run(os.path.join(tmp, cfg.train.run_name), curve_window=window)
    mismatched = [k for k in COMPARED if k in record and record[k] != fresh[k]]
    if mismatched:
        key = mismatched[0]
        log(f"[check] {name} does NOT reproduce: {', '.join(mismatched)} differ "
            f"(e.g. {key}: recorded {str(record[key])[:120]} vs now {str(fresh[key])[:120]}).")
        return False
    log(f"[check] {name} reproduces bit for bit ({', '.join(k for k in COMPARED if k in record)}).")
    return True


def reanalyze(path: str, out_path: str, *, margin_percent: float = 1.0) -> dict[str, Any]:
    """Recomputes the statistics of the study at `path` with this code and writes them to
    `out_path` with their provenance (this commit; the source file's sha256)."""
    results = load_results(path)
    study = results["study"]
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    names = [a["name"] for a in study["arms"]]
    found = analysis.analyze(results["runs"] + results.get("extended_runs", []), names, study.get("reference"),
                             study["steps"], margin_percent=margin_percent)
    out = {
        "source": {"path": path, "sha256": digest, "provenance": study.get("provenance"),
                   "eval_quantization": "train recipe forward only (predates eval modes)"
                   if not any(r.get("final_eval_loss_bf16") is not None for r in results["runs"]) else "both"},
        "recomputed_with": provenance.commit(),
        "analysis": found,
    }
    with open(out_path + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(out_path + ".tmp", out_path)
    return out
