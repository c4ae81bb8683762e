"""A study's numbers: the per-arm summary over seeds, `results.json` and `summary.md`.

The per-arm rows give each arm's final validation losses over seeds and their gap to the
reference arm (BF16) with Welch's and the paired t-test, uncorrected. The conclusions are worded
from `analysis` only: paired differences (arms of one seed share the initial weights and the
batches) with 95% intervals, Holm's correction over the study's comparisons and the TOST
equivalence test, beside the measured seed-noise floor.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

from nvfp4_jax.lab import analysis, stats

ALPHA = analysis.ALPHA
TEST = ("per-seed paired differences; 95% t and bootstrap intervals; paired t-test, two-sided, with "
        "Holm's correction over every comparison of the same metric; sign test; TOST equivalence "
        f"at the stated margin; alpha = {ALPHA}")
METRIC_TITLES = {
    "train_tail": "Training loss, mean over the last 10% of steps (the paper's metric)",
    "final_eval": "Final validation loss, the training recipe's forward pass",
    "final_eval_bf16": "Final validation loss, the same weights in BF16 (the model a user ships)",
}


def _finals(runs: Sequence[dict], arm: str) -> dict[int, float]:
    return {r["seed"]: r["final_eval_loss"] for r in runs
            if r["arm"] == arm and r.get("final_eval_loss") is not None}


def summarize(arms: Sequence[str], runs: Sequence[dict], reference: str | None) -> list[dict[str, Any]]:
    """One row per arm: its final validation losses over seeds, their mean and std, and its gap
    to `reference` (None when there is no reference or no run of it) with both tests."""
    ref = _finals(runs, reference) if reference else {}
    rows = []
    for arm in arms:
        finals = _finals(runs, arm)
        values = [finals[s] for s in sorted(finals)]
        row: dict[str, Any] = {
            "arm": arm,
            "seeds": sorted(finals),
            "final_eval_losses": values,
            "mean": stats.mean(values) if values else None,
            "std": stats.std(values),
        }
        for key, field in (("bf16_eval", "final_eval_loss_bf16"), ("train_tail", "train_tail")):
            vals = [r[field] for r in runs if r["arm"] == arm and r.get(field) is not None]
            row[f"{key}_mean"], row[f"{key}_std"] = (stats.mean(vals) if vals else None), stats.std(vals)
        tps = [r["tokens_per_second_per_device"] for r in runs
               if r["arm"] == arm and r.get("tokens_per_second_per_device")]
        row["tokens_per_second_per_device"] = stats.mean(tps) if tps else None
        common = sorted(set(finals) & set(ref))
        if common and arm != reference:
            # Against the reference's runs of the same seeds (all of them once a study is complete).
            ours, theirs = [finals[s] for s in common], [ref[s] for s in common]
            welch, pair = stats.welch(ours, theirs), stats.paired(ours, theirs)
            diffs = [a - b for a, b in zip(ours, theirs)]
            ref_mean = stats.mean(theirs)
            row.update(
                gap_seeds=common,
                gap_nats=stats.mean(ours) - ref_mean,
                gap_percent=100.0 * (stats.mean(ours) - ref_mean) / ref_mean,
                welch_t=welch.t, welch_df=welch.df, welch_p=welch.p,
                paired_gap_mean=stats.mean(diffs) if diffs else None,
                paired_gap_std=stats.std(diffs),
                paired_t=pair.t, paired_p=pair.p,
            )
        rows.append(row)
    return rows


def _clean(value: Any) -> Any:
    """JSON has no Inf/NaN: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_results(path: str, study: dict, runs: Sequence[dict], summary: Sequence[dict],
                  extra: dict | None = None) -> None:
    """results.json: the study, the per-arm summary, the runs, and `extra` (the analysis, the
    extended runs)."""
    with open(path + ".tmp", "w") as f:
        json.dump(_clean({"study": study, "summary": list(summary), "runs": list(runs), **(extra or {})}),
                  f, indent=1)
    os.replace(path + ".tmp", path)  # a reader never sees half a file


def _num(value: float | None, spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return format(value, spec)


def _p(value: float | None) -> str:
    return "n/a" if value is None else ("<0.001" if value < 0.001 else f"{value:.3f}")


def _ci(ci: Sequence[float] | None) -> str:
    return "n/a" if not ci else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"


def _comparison_tables(result: dict) -> list[str]:
    out: list[str] = []
    margin = result["margin_percent"]
    for metric, title in METRIC_TITLES.items():
        rows = [c for c in result["comparisons"] if c["metric"] == metric]
        if not rows:
            continue
        floor = result["noise_floor"].get(metric)
        out += [f"### {title}", "",
                f"Seed-noise floor (RMS sd of the per-seed differences to the reference): "
                f"{_num(floor, '.4f')} nats. Holm over {rows[0]['holm_count']} comparisons. "
                f"Equivalence margin: ±{margin:g}% of the compared-with arm.", "",
                "| arm | vs | seeds | gap (nats) | gap (%) | 95% CI (t) | 95% CI (bootstrap) | p | Holm p "
                "| sign p | TOST p | reading |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in rows:
            out.append(
                f"| `{c['arm']}` | `{c['against']}` | {c['n']} | {_num(c['gap'], '+.4f')} | "
                f"{_num(c['gap_percent'], '+.2f')} | {_ci(c['ci_t'])} | {_ci(c['ci_bootstrap'])} | "
                f"{_p(c['p'])} | {_p(c['p_holm'])} | {_p(c['p_sign'])} | {_p(c['tost_p'])} | {c['verdict']} |")
        out.append("")
    return out


def _tokens_table(result: dict) -> list[str]:
    ttt = result.get("tokens_to_target")
    if not ttt:
        return []
    out = ["### Tokens to the target loss", "",
           f"Target: {ttt['target']}; training loss smoothed over {ttt['smoothing_steps']:g} steps. "
           "Read off each arm's longest run: an extended run's schedule has not decayed where it crosses, "
           "so its steps overstate what a run scheduled to end there needs; the ratio (both on one "
           "schedule) is the comparable figure. Ratio > 1: the arm needs more tokens than `te_nvfp4` to "
           "get there. 'not reached': the run ended first (train longer with `--extend`).", "",
           "| arm | steps to target (per seed) | ratio to `te_nvfp4` (mean, 95% CI) | not reached (seeds) |",
           "|---|---|---|---|"]
    for arm, row in ttt["arms"].items():
        steps = ", ".join("—" if v is None else f"{v:.0f}" for _, v in sorted(row["steps"].items()))
        ratio = ("" if "ratio_mean" not in row else
                 f"{_num(row['ratio_mean'], '.3f')} {_ci(row.get('ratio_ci_t')).replace('+', '')}")
        out.append(f"| `{arm}` | {steps} | {ratio} | {row['not_reached_seeds'] or ''} |")
    return out + [""]


def _match_table(result: dict) -> list[str]:
    out: list[str] = []
    for ltm in (result.get("length_to_match") or {}).values():
        if not ltm["arms"]:
            continue
        out += [f"### Training length to match `{ltm['match']}`", "",
                f"Target: {ltm['target']}. Multiple: the length, in units of {ltm['steps']} steps, of a "
                f"complete run (its schedule ended) that ends at the target; {ltm['model']} (> 1: more "
                "tokens; the paper's MXFP4 figure against NVFP4 is 1.36). '*': extrapolated beyond the two "
                "runs; 'no slope': the longer run did not end lower.", "",
                "| arm | multiple (per seed) | mean, 95% CI | no slope (seeds) |",
                "|---|---|---|---|"]
        for arm, row in ltm["arms"].items():
            per_seed = ", ".join("—" if v is None else f"{v:.3f}{'*' if s in row['extrapolated_seeds'] else ''}"
                                 for s, v in sorted(row["multiple"].items()))
            mean = f"{_num(row['multiple_mean'], '.3f')} {_ci(row.get('multiple_ci_t')).replace('+', '')}"
            out.append(f"| `{arm}` | {per_seed} | {mean} | {row['no_slope_seeds'] or ''} |")
        out.append("")
    return out


def conclusions(result: dict) -> list[str]:
    """One sentence per comparison, worded from the corrected numbers only."""
    out = []
    for c in result["comparisons"]:
        what = {"train_tail": "training loss (last 10%)", "final_eval": "validation loss",
                "final_eval_bf16": "BF16-forward validation loss"}[c["metric"]]
        ci = _ci(c["ci_t"])
        if c["verdict"].startswith(("higher", "lower")):
            words = f"is {c['verdict'].split(' ')[0]} than"
        elif c["verdict"].startswith("equivalent"):
            words = f"is within ±{result['margin_percent']:g}% of"
        else:
            words = "is not distinguishable (nor shown equivalent) at this scale from"
        out.append(f"- `{c['arm']}` {words} `{c['against']}` in {what}: {_num(c['gap_percent'], '+.2f')}%, "
                   f"95% CI {ci} nats, Holm p {_p(c['p_holm'])}, {c['n']} seeds.")
    return out


def summary_markdown(study: dict, summary: Sequence[dict], result: dict | None = None) -> str:
    reference = study.get("reference")
    ref = f"`{reference}`" if reference else "none"
    prov = study.get("provenance") or {}
    lines = [
        "# Convergence study",
        "",
        f"{study['steps']} steps per run, seeds {study['seeds']}, reference arm {ref}. "
        f"Base config: {' '.join(study['base_args']) or '(defaults)'}.",
        "",
    ]
    if prov:
        dirty = " (dirty tree)" if prov.get("dirty") else ""
        device = prov.get("device", {})
        lines += [f"Commit {prov.get('commit') or 'unknown'}{dirty}; {device.get('count')} x "
                  f"{device.get('kind')} ({device.get('backend')}); jax {prov.get('versions', {}).get('jax')}. "
                  "Resolved configs: results.json `study.configs`.", ""]
    lines += [
        study["seed_note"],
        "",
        f"| arm | seeds | final val. loss (mean ± std) | BF16-forward val. loss | train loss, last 10% "
        f"| val. gap to {ref} (nats) | gap (%) | Welch t, p | paired gap ± sd, p | tokens/s/device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        gap = "gap_nats" in row
        lines.append(
            f"| `{row['arm']}` | {len(row['seeds'])} | {_num(row['mean'], '.4f')} ± {_num(row['std'], '.4f')} "
            f"| {_num(row.get('bf16_eval_mean'), '.4f')} ± {_num(row.get('bf16_eval_std'), '.4f')} "
            f"| {_num(row.get('train_tail_mean'), '.4f')} ± {_num(row.get('train_tail_std'), '.4f')} "
            f"| {_num(row['gap_nats'], '+.4f') if gap else '(reference)' if row['arm'] == reference else ''} "
            f"| {_num(row['gap_percent'], '+.2f') if gap else ''} "
            f"| {(_num(row['welch_t'], '.2f') + ', ' + _p(row['welch_p'])) if gap else ''} "
            f"| {(_num(row['paired_gap_mean'], '+.4f') + ' ± ' + _num(row['paired_gap_std'], '.4f') + ', ' + _p(row['paired_p'])) if gap else ''} "
            f"| {_num(row['tokens_per_second_per_device'], '.0f')} |"
        )
    lines += ["", "The p-values in this table are uncorrected; the conclusions below use the corrected ones.", ""]
    if result:
        lines += ["## Comparisons", "", f"Method: {TEST}.", ""]
        lines += _comparison_tables(result) + _tokens_table(result) + _match_table(result)
        lines += ["## Conclusions", ""] + conclusions(result) + [""]
    arms = study.get("arms", [])
    if arms:
        lines += ["Arms:", ""] + [f"- `{a['name']}`: {a['config'] or '(base config)'}" for a in arms] + [""]
    plots = study.get("plots")
    lines.append(f"Plots: {', '.join(plots)}." if plots else f"Plots: skipped ({study.get('plots_note', 'none')}).")
    return "\n".join(lines) + "\n"


def write_summary(path: str, study: dict, summary: Sequence[dict], result: dict | None = None) -> None:
    with open(path, "w") as f:
        f.write(summary_markdown(study, summary, result))
