"""A study's numbers: the per-arm summary over seeds, `results.json` and `summary.md`.

The gap of an arm is its mean final validation loss minus the reference arm's (BF16) over the
seeds both have run, in nats and in percent of the reference. Whether it exceeds the seed noise is decided by Welch's t-test
of the two arms' final losses over seeds (two-sided, p < 0.05): the gap against the spread the
seeds alone produce. Arms of one seed share the initial weights and the batches, so the paired
t-test of the per-seed differences is reported beside it; it is the more sensitive of the two.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

from nvfp4_jax.lab import stats

ALPHA = 0.05
TEST = (f"Welch's t-test of the final validation losses over seeds, two-sided, p < {ALPHA}; "
        "the paired t-test of the per-seed differences is shown beside it")


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
                beyond_seed_noise=None if welch.p is None else welch.p < ALPHA,
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


def write_results(path: str, study: dict, runs: Sequence[dict], summary: Sequence[dict]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(_clean({"study": study, "summary": list(summary), "runs": list(runs)}), f, indent=1)
    os.replace(path + ".tmp", path)  # a reader never sees half a file


def _num(value: float | None, spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return format(value, spec)


def _p(value: float | None) -> str:
    return "n/a" if value is None else ("<0.001" if value < 0.001 else f"{value:.3f}")


def summary_markdown(study: dict, summary: Sequence[dict]) -> str:
    reference = study.get("reference")
    ref = f"`{reference}`" if reference else "none"
    lines = [
        "# Convergence study",
        "",
        f"{study['steps']} steps per run, seeds {study['seeds']}, reference arm {ref}. "
        f"Base config: {' '.join(study['base_args']) or '(defaults)'}.",
        "",
        study["seed_note"],
        "",
        f"| arm | seeds | final val. loss (mean ± std) | gap to {ref} (nats) | gap (%) | Welch t, p "
        "| paired gap ± sd, p | beyond seed noise | tokens/s/device |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        gap = "gap_nats" in row
        verdict = {True: "yes", False: "no", None: "n/a"}[row.get("beyond_seed_noise")] if gap else ""
        lines.append(
            f"| `{row['arm']}` | {len(row['seeds'])} | {_num(row['mean'], '.4f')} ± {_num(row['std'], '.4f')} "
            f"| {_num(row['gap_nats'], '+.4f') if gap else '(reference)' if row['arm'] == reference else ''} "
            f"| {_num(row['gap_percent'], '+.2f') if gap else ''} "
            f"| {(_num(row['welch_t'], '.2f') + ', ' + _p(row['welch_p'])) if gap else ''} "
            f"| {(_num(row['paired_gap_mean'], '+.4f') + ' ± ' + _num(row['paired_gap_std'], '.4f') + ', ' + _p(row['paired_p'])) if gap else ''} "
            f"| {verdict} | {_num(row['tokens_per_second_per_device'], '.0f')} |"
        )
    lines += ["", f"Test: {TEST}.", ""]
    arms = study.get("arms", [])
    if arms:
        lines += ["Arms:", ""] + [f"- `{a['name']}`: {a['config'] or '(base config)'}" for a in arms] + [""]
    plots = study.get("plots")
    lines.append(f"Plots: {', '.join(plots)}." if plots else f"Plots: skipped ({study.get('plots_note', 'none')}).")
    return "\n".join(lines) + "\n"


def write_summary(path: str, study: dict, summary: Sequence[dict]) -> None:
    with open(path, "w") as f:
        f.write(summary_markdown(study, summary))
