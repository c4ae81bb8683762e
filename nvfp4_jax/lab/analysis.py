"""What a study's runs say, with their uncertainty: the paper's metrics and the statistics behind
every sentence of `summary.md`.

Metrics, per (arm, seed):
- `final_eval`: the final validation loss through the training recipe's forward pass;
- `final_eval_bf16`: the same weights evaluated in BF16 (the model a user ships), when the
  runs evaluated both ways (`eval_quantization`);
- `train_tail`: the mean training loss over the last `TAIL_FRACTION` of the steps, the
  paper's headline metric (a training-loss gap);
- `tokens_to_target`: tokens until the smoothed training loss first reaches a target, by
  default the reference arm's `train_tail` of the same seed, read off the arm's extended run
  (`--extend`). That run's schedule has not decayed yet where it crosses, so the step overstates
  what a run scheduled to end there would need; its ratio to NVFP4's (same schedule) is the
  comparable figure;
- `length_to_match`: the paper's framing ("MXFP4 needs 36% more tokens to match NVFP4"): the
  length, as a multiple of the study's steps, of a run that ends (schedule and all) at another
  arm's `train_tail`, interpolated between the arm's two complete runs, at the study's length
  and at `extend` times it, as linear in log(steps).

A comparison is `arm` against `against` on the seeds both ran; its per-seed differences get a
mean (nats and percent), the t and bootstrap 95% intervals, the paired t-test, the sign test,
Holm's correction over every comparison of that metric in the study, and the TOST equivalence
test at +-`margin_percent`%. The seed-noise floor is the root-mean-square standard deviation of
the per-seed differences of the comparisons to the reference: how far apart two arms of one seed
land when nothing but the seed-specific noise differs.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from nvfp4_jax.lab import stats

ALPHA = 0.05
TAIL_FRACTION = 0.1
METRICS = ("train_tail", "final_eval", "final_eval_bf16")
RECIPE = "te_nvfp4"  # the arm the NVFP4 ablations and MXFP4 are compared with
FP8 = "te_fp8_delayedscaling"


def tail_mean(curve: Sequence[Sequence[float]], steps: int, fraction: float = TAIL_FRACTION) -> float | None:
    """Mean of a `[[step, loss], ...]` curve over its points after `(1 - fraction) * steps`."""
    start = (1.0 - fraction) * steps
    values = [loss for step, loss in curve if step > start]
    return sum(values) / len(values) if values else None


def smoothed(curve: Sequence[Sequence[float]], span: float) -> list[tuple[float, float]]:
    """Trailing mean of a `[[step, loss], ...]` curve over the points in the last `span` steps
    (the points themselves are already means over `curve_window` steps)."""
    out = []
    for i, (step, _) in enumerate(curve):
        window = [loss for s, loss in curve[: i + 1] if s > step - span]
        out.append((step, sum(window) / len(window)))
    return out


def steps_to_target(curve: Sequence[Sequence[float]], target: float, span: float = 0.0) -> float | None:
    """The first step at which a `[[step, loss], ...]` curve, smoothed over `span` steps,
    reaches `target`, interpolated linearly between the points around the crossing; None
    when it never does. Smoothing over the span the target was averaged over keeps a single
    lucky window from counting as reaching it."""
    previous = None
    for step, loss in (smoothed(curve, span) if span > 0 else curve):
        if loss <= target:
            if previous is None:
                return float(step)
            (s0, l0) = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = (step, loss)
    return None


def run_metrics(run: dict, steps: int) -> dict[str, float | None]:
    return {
        "final_eval": run.get("final_eval_loss"),
        "final_eval_bf16": run.get("final_eval_loss_bf16"),
        "train_tail": tail_mean(run.get("loss_curve") or [], run.get("steps") or steps),
    }


def default_comparisons(arms: Sequence[str], reference: str | None) -> list[tuple[str, str]]:
    """Every arm against the reference; NVFP4 against FP8; every other 4-bit arm against NVFP4;
    and MXFP4 under the NVFP4 recipe against plain MXFP4 (the recipe's effect on that format,
    beside its row against NVFP4: the format's effect)."""
    pairs = [(a, reference) for a in arms if reference and a != reference]
    if RECIPE in arms:
        if FP8 in arms:
            pairs.append((RECIPE, FP8))
        pairs += [(a, RECIPE) for a in arms if a not in (RECIPE, FP8, reference)
                  and ("fp4" in a)]
    if "mxfp4_nvfp4_recipe" in arms and "mxfp4" in arms:
        pairs.append(("mxfp4_nvfp4_recipe", "mxfp4"))
    return pairs


def compare(d: Sequence[float], against_mean: float, margin_percent: float) -> dict[str, Any]:
    """The statistics of one comparison's per-seed differences `d` (nats)."""
    n = len(d)
    out: dict[str, Any] = {"n": n, "diffs": list(d), "gap": stats.mean(d) if n else None}
    out["gap_percent"] = 100.0 * out["gap"] / against_mean if n else None
    out["sd"] = stats.std(d)
    t_ci = stats.t_interval(d)
    b_ci = stats.bootstrap_interval(d)
    out["ci_t"] = list(t_ci) if t_ci else None
    out["ci_bootstrap"] = list(b_ci) if b_ci else None
    pair = stats.paired(d, [0.0] * n) if n >= 2 else None
    out["p"] = pair.p if pair else None
    out["p_sign"] = stats.sign_test(d) if n else None
    margin = margin_percent / 100.0 * against_mean
    eq = stats.tost(d, margin) if n >= 2 else None
    out["tost_margin"] = margin
    out["tost_p"] = eq.p if eq else None
    return out


def verdict(c: dict[str, Any], margin_percent: float) -> str:
    """Words for one comparison, decided by the corrected numbers only."""
    if c.get("p_holm") is not None and c["p_holm"] < ALPHA:
        return "higher (Holm p < 0.05)" if c["gap"] > 0 else "lower (Holm p < 0.05)"
    if c.get("tost_p") is not None and c["tost_p"] < ALPHA:
        return f"equivalent within ±{margin_percent:g}% (TOST p < 0.05)"
    return "not resolved at this scale"


def analyze(runs: Sequence[dict], arms: Sequence[str], reference: str | None, steps: int, *,
            comparisons: Sequence[tuple[str, str]] | None = None, margin_percent: float = 1.0,
            tokens_per_step: int | None = None) -> dict[str, Any]:
    """The study's statistics from its runs (the records `results.json` holds)."""
    per: dict[str, dict[int, dict]] = {a: {} for a in arms}
    curves: dict[str, dict[int, list]] = {a: {} for a in arms}  # the study-length runs
    longest: dict[str, dict[int, list]] = {a: {} for a in arms}  # extended where there is one
    extended: dict[str, dict[int, tuple[float, int]]] = {a: {} for a in arms}  # (tail, steps)
    for run in sorted(runs, key=lambda r: bool(r.get("extended"))):
        if run["arm"] not in per or str(run.get("status", "")).startswith("diverged"):
            continue
        # An extended run (`--extend`) trains past the study's steps only for tokens-to-target
        # and length-to-match; its schedule differs, so it feeds nothing else.
        curve = run.get("loss_curve") or []
        if run.get("extended"):
            run_steps = run.get("steps") or (curve[-1][0] if curve else 0)
            tail = tail_mean(curve, run_steps)
            if tail is not None:
                extended[run["arm"]][run["seed"]] = (tail, run_steps)
        else:
            per[run["arm"]][run["seed"]] = run_metrics(run, steps)
            curves[run["arm"]][run["seed"]] = curve
        longest[run["arm"]][run["seed"]] = curve
    pairs = list(comparisons) if comparisons is not None else default_comparisons(arms, reference)
    out: dict[str, Any] = {"alpha": ALPHA, "tail_fraction": TAIL_FRACTION, "margin_percent": margin_percent,
                           "comparisons": [], "noise_floor": {}, "tokens_to_target": None,
                           "length_to_match": {}}
    for metric in METRICS:
        rows = []
        for arm, against in pairs:
            seeds = sorted(s for s in per.get(arm, {}) if s in per.get(against, {})
                           and per[arm][s][metric] is not None and per[against][s][metric] is not None)
            if not seeds:
                continue
            d = [per[arm][s][metric] - per[against][s][metric] for s in seeds]
            ref_mean = stats.mean([per[against][s][metric] for s in seeds])
            rows.append({"metric": metric, "arm": arm, "against": against, "seeds": seeds,
                         **compare(d, ref_mean, margin_percent)})
        for row, p in zip(rows, stats.holm([r["p"] for r in rows])):
            row["p_holm"] = p
            row["holm_count"] = sum(r["p"] is not None for r in rows)
            row["verdict"] = verdict(row, margin_percent)
        out["comparisons"] += rows
        sds = [r["sd"] for r in rows if r["against"] == reference and r["sd"] is not None]
        if sds:
            out["noise_floor"][metric] = math.sqrt(sum(s * s for s in sds) / len(sds))
    out["ranking_by_seed"] = ranking_by_seed(per, "final_eval")
    out["train_gap_by_quarter"] = {
        f"{arm} vs {against}": gap_by_segment(curves.get(arm, {}), curves.get(against, {}), steps)
        for arm, against in pairs}
    if reference in per:
        out["tokens_to_target"] = tokens_to_target(per, longest, reference, tokens_per_step,
                                                   span=TAIL_FRACTION * steps)
    if any(extended.values()):
        for match in (reference, RECIPE):
            if match in per:
                out["length_to_match"][match] = length_to_match(per, extended, match, steps)
    return out


def ranking_by_seed(per: dict, metric: str) -> dict[int, list[list]]:
    """Per seed, [[arm, value], ...] from the lowest `metric` to the highest."""
    seeds = sorted({s for by_seed in per.values() for s in by_seed})
    return {s: sorted(([a, by_seed[s][metric]] for a, by_seed in per.items()
                       if s in by_seed and by_seed[s][metric] is not None), key=lambda av: av[1])
            for s in seeds}


def gap_by_segment(ours: dict, theirs: dict, steps: int, segments: int = 4) -> list[float | None]:
    """The mean over common seeds of the percent gap of the mean training loss in each of
    `segments` equal spans of the steps (how a gap develops over training)."""
    out = []
    for i in range(segments):
        lo, hi = i * steps / segments, (i + 1) * steps / segments
        gaps = []
        for s in sorted(set(ours) & set(theirs)):
            a = [l for st, l in ours[s] if lo < st <= hi]
            b = [l for st, l in theirs[s] if lo < st <= hi]
            if a and b:
                gaps.append(100.0 * (stats.mean(a) - stats.mean(b)) / stats.mean(b))
        out.append(stats.mean(gaps) if gaps else None)
    return out


def tokens_to_target(per: dict, curves: dict, reference: str, tokens_per_step: int | None,
                     span: float) -> dict[str, Any]:
    """Per arm and seed, the step (and tokens) at which its training loss, smoothed over `span`
    steps, reaches the reference arm's `train_tail` of the same seed, and each arm's ratio to
    the NVFP4 arm's (> 1: it needs more tokens)."""
    targets = {s: m["train_tail"] for s, m in per[reference].items() if m["train_tail"] is not None}
    reach = {arm: {s: steps_to_target(c, targets[s], span) for s, c in by_seed.items() if s in targets}
             for arm, by_seed in curves.items()}
    rows = {}
    for arm, reached in reach.items():
        row: dict[str, Any] = {"steps": reached}
        if tokens_per_step:
            row["tokens"] = {s: None if v is None else v * tokens_per_step for s, v in reached.items()}
        if RECIPE in reach and arm != RECIPE:
            base = reach[RECIPE]
            ratios = [reached[s] / base[s] for s in reached if reached[s] and base.get(s)]
            row["ratio_to_nvfp4"] = ratios
            row["ratio_mean"] = stats.mean(ratios) if ratios else None
            ci = stats.t_interval(ratios)
            row["ratio_ci_t"] = list(ci) if ci else None
        row["not_reached_seeds"] = sorted(s for s in reached if reached[s] is None)
        rows[arm] = row
    return {"target": "the reference arm's mean training loss over the last "
                      f"{TAIL_FRACTION:.0%} of its steps, per seed", "smoothing_steps": span,
            "targets": targets, "arms": rows}


def length_to_match(per: dict, extended: dict, match: str, steps: int) -> dict[str, Any]:
    """Per arm and seed, the length (a multiple of the study's `steps`) of a complete run whose
    final training loss equals `match`'s `train_tail` of the same seed: the paper's "MXFP4 needs
    36% more tokens to match NVFP4", where every point is a run that ended with its schedule.

    Each arm has two such runs, the study's (`train_tail` L1 at `steps`) and its extended one
    (tail L2 at E x `steps`); the final loss is taken as linear in log(steps) between them, so
    the multiple is E ** ((L1 - target) / (L1 - L2)). Outside [1, E] that is an extrapolation
    (flagged per seed); when the extended run ends no lower than the study's run there is no
    slope to follow (None)."""
    targets = {s: m["train_tail"] for s, m in per[match].items() if m["train_tail"] is not None}
    rows = {}
    for arm, by_seed in extended.items():
        if arm == match or not by_seed:
            continue
        multiple: dict[int, float | None] = {}
        outside = []
        for seed, (tail_long, steps_long) in by_seed.items():
            tail = per.get(arm, {}).get(seed, {}).get("train_tail")
            if seed not in targets or tail is None or not tail_long < tail:
                multiple[seed] = None
                continue
            multiple[seed] = (steps_long / steps) ** ((tail - targets[seed]) / (tail - tail_long))
            if not 1.0 <= multiple[seed] <= steps_long / steps:
                outside.append(seed)
        values = [v for v in multiple.values() if v is not None]
        ci = stats.t_interval(values)
        rows[arm] = {"multiple": multiple, "multiple_mean": stats.mean(values) if values else None,
                     "multiple_ci_t": list(ci) if ci else None, "extrapolated_seeds": sorted(outside),
                     "no_slope_seeds": sorted(s for s, v in multiple.items() if v is None)}
    return {"target": f"`{match}`'s mean training loss over the last {TAIL_FRACTION:.0%} of the study's "
                      f"{steps} steps, per seed", "match": match, "steps": steps,
            "model": "final training loss linear in log(steps) between each arm's two complete runs",
            "targets": targets, "arms": rows}
