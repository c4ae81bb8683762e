"""Regenerating a study's numbers: `--check` re-runs one of its runs and says whether it
reproduces bit for bit; `--analyze` recomputes the statistics of an existing results.json.

`--check` first recomputes every number results.json derives from the recorded curves and final
losses (each run's `train_tail`, the per-arm `summary`, the `analysis`) and fails, naming each
one that differs, when the file does not bear them out (edited by hand, or written by other
code). It then compares the run's recorded resolved config with what this code resolves from the
study's own command (base args and arm spec): a default that changed since, or a hand-edited
results file, is a difference. Both are reported before anything trains.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any, Callable

from nvfp4_jax.config import config_layers, from_dict, to_dict
from nvfp4_jax.lab import analysis, provenance, report, runs
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
    if not isinstance(results["study"], dict) or not isinstance(results["runs"], list):
        raise runs.LabError(f"{path}: `study` must be an object and `runs` a list.")
    return results


_MISSING = object()


def field(obj: Any, key: str, where: str, path: str) -> Any:
    """`obj[key]`; a LabError naming `where.key` in `path` when obj is not an object or lacks it."""
    value = obj.get(key, _MISSING) if isinstance(obj, dict) else _MISSING
    if value is _MISSING:
        raise runs.LabError(f"{path}: {where} has no `{key}` field; a lab results.json records it "
                            "(written by `python -m nvfp4_jax.lab`).")
    return value


def _run_label(run: Any, index: int, where: str = "runs") -> str:
    """`runs[3] (te_nvfp4-seed1)`: a run's place in results.json and, where it says, its name."""
    name = ""
    if isinstance(run, dict):
        name = os.path.basename(str(run["run_directory"])) if run.get("run_directory") else (
            f"{run['arm']}-seed{run['seed']}" if "arm" in run and "seed" in run else "")
    return f"{where}[{index}]" + (f" ({name})" if name else "")


def _labels(results: dict) -> list[str]:
    """`_run_label` of every run, then of every extended run."""
    return [_run_label(r, i) for i, r in enumerate(results["runs"])] + [
        _run_label(r, i, "extended_runs") for i, r in enumerate(results.get("extended_runs") or [])]


def _check_inputs(results: dict, path: str) -> None:
    """What --check reads of results.json, each a LabError naming the missing field."""
    study = results["study"]
    field(study, "base_args", "study", path)
    for a, arm in enumerate(field(study, "arms", "study", path)):
        field(arm, "name", f"study.arms[{a}]", path)
    for i, run in enumerate(results["runs"]):
        for key in ("run_directory", "arm", "seed"):
            field(run, key, _run_label(run, i), path)


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
    spec = next((a.get("spec", a["name"]) for a in study["arms"] if a["name"] == record["arm"]), record["arm"])
    wanted = arm_config(config_layers(study["base_args"]), parse_arm(spec), record["seed"],
                        saved["train"]["base_output_directory"])
    recorded = from_dict(saved)
    return recorded, runs.config_changes(to_dict(recorded), wanted)


def _tokens_per_step(study: dict) -> int | None:
    """The tokens one step trains on, as the study computed them for tokens-to-target: recorded
    (`study.tokens_per_step`), or, in a file from before it was, from the first run's config and
    the recorded device count; None when neither is there."""
    if study.get("tokens_per_step") is not None:
        return study["tokens_per_step"]
    configs = study.get("configs") or {}
    count = ((study.get("provenance") or {}).get("device") or {}).get("count")
    if not configs or not count:
        return None
    first = next(iter(configs.values()))
    try:
        return first["model"]["max_target_length"] * first["train"]["per_device_batch_size"] * count
    except (KeyError, TypeError):
        return None


def rederive(results: dict, path: str) -> dict[str, Any]:
    """What the study derives from its runs' curves and final losses, recomputed with this code as
    `run_study` computes it, in results.json's form: {"train_tails": [per run, then per extended
    run], "summary": [...], "analysis": {...}}."""
    names, steps, every_run = _analysis_inputs(results, path)
    study = results["study"]
    labels = _labels(results)
    tails = [analysis.tail_mean(field(run, "loss_curve", label, path), field(run, "steps", label, path))
             for label, run in zip(labels, every_run)]
    rederived = [{**run, "train_tail": tail} for run, tail in zip(every_run, tails)]
    regular = rederived[:len(results["runs"])]
    summary = report.summarize(names, regular, study["reference"])
    found = analysis.analyze(rederived, names, study["reference"], steps,
                             margin_percent=study.get("margin_percent", 1.0),
                             tokens_per_step=_tokens_per_step(study))
    # through JSON as results.json was (inf/nan as strings, integer keys as strings, tuples as lists)
    return json.loads(json.dumps(report._clean({"train_tails": tails, "summary": summary, "analysis": found})))


def _differences(recorded: Any, fresh: Any, where: str) -> list[tuple[str, Any, Any]]:
    """(where, recorded, recomputed) for every value in which `recorded` is not `fresh` exactly;
    a key or list item on one side only is a difference too, except a key the file lacks whose
    recomputed value holds no number ({}, [] or None: a field added since, in an older file)."""
    if recorded is _MISSING and fresh in ({}, [], None):
        return []
    if isinstance(recorded, dict) and isinstance(fresh, dict):
        out = []
        for key in list(fresh) + [k for k in recorded if k not in fresh]:
            out += _differences(recorded.get(key, _MISSING), fresh.get(key, _MISSING), f"{where}.{key}")
        return out
    if isinstance(recorded, list) and isinstance(fresh, list) and len(recorded) == len(fresh):
        return [d for i, (a, b) in enumerate(zip(recorded, fresh)) for d in _differences(a, b, f"{where}[{i}]")]
    same = type(recorded) is type(fresh) and recorded == fresh
    return [] if same else [(where, recorded, fresh)]


def derived_differences(results: dict, path: str) -> list[tuple[str, Any, Any]]:
    """(where, recorded, recomputed) for each derived number of results.json (`train_tail` of
    every run, `summary`, `analysis`) that is not what its curves and final losses give."""
    fresh = rederive(results, path)
    out = []
    for label, run, tail in zip(_labels(results), results["runs"] + (results.get("extended_runs") or []),
                                fresh["train_tails"]):
        out += _differences(run.get("train_tail", _MISSING), tail, f"{label}.train_tail")
    for key in ("summary", "analysis"):
        out += _differences(field(results, key, "the file", path), fresh[key], key)
    return out


def _shown(value: Any) -> str:
    return "(absent)" if value is _MISSING else str(value)[:60]


def check(path: str, *, which: str | None = None, devices=None, log: Callable[[str], None] = print) -> bool:
    """Re-runs one run of the study at `path` in a fresh directory; True when it reproduces its
    recorded curve and final losses bit for bit. Derived numbers that the file's curves and final
    losses do not bear out, or a changed config, return False before training."""
    results = load_results(path)
    _check_inputs(results, path)
    record = _find_run(results, which)
    derived = derived_differences(results, path)
    if derived:
        shown = "; ".join(f"{where}: recorded {_shown(old)} vs recomputed {_shown(new)}"
                          for where, old, new in derived[:5])
        more = f" (and {len(derived) - 5} more)" if len(derived) > 5 else ""
        log(f"[check] {path}: {len(derived)} derived number(s) are not what its curves and final losses "
            f"give: {shown}{more}. Not reproducible as recorded (the file was edited, or written by other code).")
        return False
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


def _analysis_inputs(results: dict, path: str) -> tuple[list[str], int, list[dict]]:
    """(arm names, steps, runs) of the study at `path` for --analyze; a LabError naming the field
    (and the run) when one the statistics need is missing, rather than a comparison silently
    dropped: no runs, no reference (or no run of it), a finished run without `final_eval_loss`
    or with an empty `loss_curve`. A run recorded as diverged has no final loss by design."""
    study = results["study"]
    arms = field(study, "arms", "study", path)
    if not isinstance(arms, list) or not arms:
        raise runs.LabError(f"{path}: study.arms is {arms!r}; it must list the study's arms.")
    names = [field(a, "name", f"study.arms[{i}]", path) for i, a in enumerate(arms)]
    steps = field(study, "steps", "study", path)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise runs.LabError(f"{path}: study.steps is {steps!r}; it must be a positive whole number of steps.")
    reference = field(study, "reference", "study", path)
    if not results["runs"]:
        raise runs.LabError(f"{path}: `runs` is empty: there is nothing to analyze.")
    extended = results.get("extended_runs") or []
    if not isinstance(extended, list):
        raise runs.LabError(f"{path}: `extended_runs` must be a list.")
    decoded = []
    for label, run in zip(_labels(results), results["runs"] + extended):
        decoded.append(_decoded(run, label, path))
        arm = field(run, "arm", label, path)
        if arm not in names:
            raise runs.LabError(f"{path}: {label} has arm {arm!r}, which is not in study.arms "
                                f"({', '.join(map(str, names))}).")
        field(run, "seed", label, path)
        if str(run.get("status", "")).startswith("diverged"):
            continue
        if not run.get("extended") and run.get("final_eval_loss") is None:
            raise runs.LabError(f"{path}: {label} has no `final_eval_loss` (and is not recorded as diverged): "
                                "its comparisons would be dropped. Complete the run or remove it.")
        if not run.get("loss_curve"):
            raise runs.LabError(f"{path}: {label} has an empty or missing `loss_curve`: its training-loss "
                                "comparisons would be dropped. Complete the run or remove it.")
    if reference is not None and not any(r.get("arm") == reference and not r.get("extended")
                                         for r in results["runs"]):
        raise runs.LabError(f"{path}: study.reference is {reference!r}, but no run of that arm is recorded: "
                            "every comparison with it would be dropped.")
    return names, steps, decoded


# How report.write_results writes a non-finite float (JSON has none): e.g. a diverged run's curve.
_NON_FINITE = ("nan", "inf", "-inf")
_NOT_A_LOSS = object()


def _loss(value: Any) -> Any:
    """A recorded loss as the study held it: "nan"/"inf"/"-inf" back to floats, None and numbers
    as they are, anything else `_NOT_A_LOSS`."""
    if isinstance(value, str):
        return float(value) if value in _NON_FINITE else _NOT_A_LOSS
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return value if value is None or number else _NOT_A_LOSS


def _decoded(run: Any, label: str, path: str) -> Any:
    """`run` with its final losses and `loss_curve` decoded (`_loss`); a LabError naming the value
    when one is not a loss (a number or null) or a curve point not a [step, loss] pair."""
    if not isinstance(run, dict):
        return run  # refused, named, by the field checks
    out = dict(run)
    for key in ("final_eval_loss", "final_eval_loss_bf16"):
        out[key] = _loss(run.get(key))
        if out[key] is _NOT_A_LOSS:
            raise runs.LabError(f"{path}: {label}.{key} is {run.get(key)!r}: it must be a number or null.")
    curve = run.get("loss_curve")
    if curve is not None:
        if not isinstance(curve, list):
            raise runs.LabError(f"{path}: {label}.loss_curve is {curve!r}: it must be a list of [step, loss] pairs.")
        out["loss_curve"] = []
        for j, point in enumerate(curve):
            ok = (isinstance(point, list) and len(point) == 2 and not isinstance(point[0], (str, bool))
                  and isinstance(point[0], (int, float)) and _loss(point[1]) not in (_NOT_A_LOSS, None))
            if not ok:
                raise runs.LabError(f"{path}: {label}.loss_curve[{j}] is {point!r}: it must be a [step, loss] "
                                    "pair of numbers.")
            out["loss_curve"].append([point[0], _loss(point[1])])
    return out


def reanalyze(path: str, out_path: str, *, margin_percent: float = 1.0) -> dict[str, Any]:
    """Recomputes the statistics of the study at `path` with this code and writes them to
    `out_path` with their provenance (this commit; the source file's sha256)."""
    results = load_results(path)
    study = results["study"]
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    names, steps, every_run = _analysis_inputs(results, path)
    found = analysis.analyze(every_run, names, study["reference"], steps, margin_percent=margin_percent)
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
