"""The lab's metrics on synthetic curves with known answers: the training-loss tail, tokens to a
target loss and its ratio to NVFP4, the comparisons with their Holm correction and verdicts."""

import math

import pytest

from nvfp4_jax.lab import analysis, report, stats


def _curve(fn, steps, window=10):
    return [[s, fn(s)] for s in range(window, steps + 1, window)]


def test_tail_mean_averages_the_last_tenth_of_the_steps():
    curve = _curve(lambda s: float(s), 600)
    # Points after step 540: 550..600 -> mean 575.
    assert analysis.tail_mean(curve, 600) == pytest.approx(575.0)
    assert analysis.tail_mean(curve, 600, fraction=0.5) == pytest.approx(sum(range(310, 601, 10)) / 30)
    assert analysis.tail_mean([], 600) is None


def test_steps_to_target_interpolates_the_crossing_of_a_known_curve():
    # loss = 3 - s / 100 reaches 1.255 at s = 174.5 exactly (between the points 170 and 180).
    curve = _curve(lambda s: 3.0 - s / 100.0, 300)
    assert analysis.steps_to_target(curve, 1.255) == pytest.approx(174.5)
    assert analysis.steps_to_target(curve, 3.5) == 10.0  # already below at the first point
    assert analysis.steps_to_target(curve, -1.0) is None
    # A trailing mean over 50 steps of a line lags it by 20 steps (mean of s-40..s): 194.5.
    assert analysis.steps_to_target(curve, 1.255, span=50) == pytest.approx(194.5)


def test_a_single_lucky_window_does_not_reach_the_target_once_smoothed():
    curve = _curve(lambda s: 2.0, 200)
    curve[5][1] = 0.5  # one noisy window
    assert analysis.steps_to_target(curve, 1.5) == pytest.approx(50 + 10 * 0.5 / 1.5)  # interpolated
    assert analysis.steps_to_target(curve, 1.5, span=100) is None


def _runs(arm, losses_by_seed, fn_by_seed=None, steps=600, **extra):
    out = []
    for seed, loss in losses_by_seed.items():
        fn = fn_by_seed[seed] if fn_by_seed else (lambda s: 2.0)
        out.append({"arm": arm, "seed": seed, "status": "trained", "final_eval_loss": loss, "steps": steps,
                    "loss_curve": _curve(fn, steps), **extra})
    return out


def _linear_arm(name, k, steps):
    """Two seeds of an arm whose loss falls as 10 - s / (100 k); past 600 steps, an extended run."""
    fn = lambda s: 10.0 - s / (100.0 * k)
    return _runs(name, {0: 1.0, 1: 1.0}, {0: fn, 1: fn}, steps=steps, extended=steps > 600)


def test_tokens_to_target_and_the_ratio_to_nvfp4_on_curves_with_known_answers():
    # Linear losses 10 - s / (100 k): BF16 (k = 1) averages 10 - 5.75 = 4.25 over its last 10%
    # (points 550..600). Smoothed over 60 steps (six points s-50..s) a line lags by 25 steps,
    # so an arm of slope 1/(100 k) reaches 4.25 at 100 k * 5.75 + 25: NVFP4 (k = 1.1) at 657.5,
    # MXFP4 (k = 1.32) at 784, both past the 600 steps: only their extended runs get there.
    runs = _linear_arm("bf16", 1.0, 600) + _linear_arm("te_nvfp4", 1.1, 600) + _linear_arm("te_nvfp4", 1.1, 900) \
        + _linear_arm("mxfp4", 1.32, 600) + _linear_arm("mxfp4", 1.32, 900)
    out = analysis.analyze(runs, ["bf16", "te_nvfp4", "mxfp4"], "bf16", 600, tokens_per_step=1000)
    ttt = out["tokens_to_target"]
    assert ttt["targets"][0] == pytest.approx(4.25)
    assert ttt["arms"]["te_nvfp4"]["steps"][0] == pytest.approx(657.5)
    assert ttt["arms"]["mxfp4"]["steps"][0] == pytest.approx(784.0)
    assert ttt["arms"]["mxfp4"]["ratio_mean"] == pytest.approx(784.0 / 657.5)
    assert ttt["arms"]["mxfp4"]["tokens"][0] == pytest.approx(784_000.0)
    assert ttt["arms"]["mxfp4"]["not_reached_seeds"] == []
    # BF16 reaches its own tail mean 25 steps after the middle of its tail window.
    assert ttt["arms"]["bf16"]["steps"][0] == pytest.approx(600.0)
    # The extended runs feed tokens-to-target only: gaps come from the 600-step runs.
    tail = {(c["arm"], c["against"]): c for c in out["comparisons"] if c["metric"] == "train_tail"}
    gap = tail[("te_nvfp4", "bf16")]["gap"]
    assert gap == pytest.approx(analysis.tail_mean(_curve(lambda s: 10 - s / 110.0, 600), 600) - 4.25)


def _flat_arm(name, base_loss, extended_loss=None):
    """Two seeds of an arm whose 600-step run ends at `base_loss` and, if given, whose 900-step
    extended run ends at `extended_loss` (flat curves: the tail mean is the loss)."""
    runs = _runs(name, {0: 1.0, 1: 1.0}, {0: lambda s: base_loss, 1: lambda s: base_loss})
    if extended_loss is not None:
        runs += _runs(name, {0: 1.0, 1: 1.0}, {0: lambda s: extended_loss, 1: lambda s: extended_loss},
                      steps=900, extended=True)
    return runs


def test_length_to_match_interpolates_complete_runs_in_log_steps():
    # The paper's framing: the length of a run that ends at another arm's loss. Between a run of
    # 600 steps ending at L1 and one of 900 ending at L2, a target T is reached at
    # 1.5 ** ((L1 - T) / (L1 - L2)) times 600 steps.
    runs = (_flat_arm("bf16", 2.00) + _flat_arm("te_fp8_delayedscaling", 2.02, 1.98)
            + _flat_arm("te_nvfp4", 2.10, 2.00) + _flat_arm("mxfp4", 2.20, 2.05)
            + _flat_arm("te_nvfp4_no_rht", 2.12, 2.12))
    arms = ["bf16", "te_fp8_delayedscaling", "te_nvfp4", "mxfp4", "te_nvfp4_no_rht"]
    out = analysis.analyze(runs, arms, "bf16", 600)
    to_nvfp4 = out["length_to_match"]["te_nvfp4"]
    assert to_nvfp4["targets"][0] == pytest.approx(2.10)
    mx = to_nvfp4["arms"]["mxfp4"]
    assert mx["multiple"][0] == pytest.approx(1.5 ** (2 / 3))  # 1.31: inside [1, 1.5]
    assert mx["multiple_mean"] == pytest.approx(1.5 ** (2 / 3)) and mx["extrapolated_seeds"] == []
    fp8 = to_nvfp4["arms"]["te_fp8_delayedscaling"]
    assert fp8["multiple"][1] == pytest.approx(1.5 ** -2) and fp8["extrapolated_seeds"] == [0, 1]
    # No extended run that ends lower: no slope to follow.
    assert to_nvfp4["arms"]["te_nvfp4_no_rht"]["multiple"] == {0: None, 1: None}
    assert to_nvfp4["arms"]["te_nvfp4_no_rht"]["no_slope_seeds"] == [0, 1]
    assert "te_nvfp4" not in to_nvfp4["arms"] and "bf16" not in to_nvfp4["arms"]  # bf16: no extended run
    to_bf16 = out["length_to_match"]["bf16"]
    assert to_bf16["arms"]["te_nvfp4"]["multiple"][0] == pytest.approx(1.5)
    assert to_bf16["arms"]["mxfp4"]["multiple"][0] == pytest.approx(1.5 ** (4 / 3))
    assert to_bf16["arms"]["mxfp4"]["extrapolated_seeds"] == [0, 1]
    table = "\n".join(report._match_table(out))
    assert "### Training length to match `te_nvfp4`" in table
    assert "| `mxfp4` | 1.310, 1.310 | 1.310 [1.3104, 1.3104] |  |" in table
    assert "| `te_fp8_delayedscaling` | 0.444*, 0.444* |" in table
    # Without extended runs there is nothing to interpolate.
    short = [r for r in runs if not r.get("extended")]
    assert analysis.analyze(short, arms, "bf16", 600)["length_to_match"] == {}


def test_extended_runs_stay_out_of_the_gap_by_quarter():
    # An extended run trains on another schedule: the quarter gaps compare study-length runs.
    runs = _flat_arm("bf16", 2.00) + _flat_arm("te_nvfp4", 2.10, 1.00)
    out = analysis.analyze(runs, ["bf16", "te_nvfp4"], "bf16", 600)
    assert out["train_gap_by_quarter"]["te_nvfp4 vs bf16"] == pytest.approx([5.0, 5.0, 5.0, 5.0])


def test_comparisons_holm_and_verdicts_follow_the_corrected_numbers():
    base = {0: 2.00, 1: 2.10, 2: 1.95, 3: 2.05, 4: 2.02}
    runs = _runs("bf16", base)
    # A clear +5% gap; an arm within 0.05%: equivalent at +-1%; a noisy one: not resolved.
    runs += _runs("te_nvfp4", {s: v * 1.05 for s, v in base.items()})
    runs += _runs("te_fp8_delayedscaling", {s: v + (0.001 if s % 2 else -0.001) for s, v in base.items()})
    runs += _runs("mxfp4", {s: v + d for (s, v), d in zip(base.items(), (0.06, -0.05, 0.07, -0.04, 0.0))})
    out = analysis.analyze(runs, ["bf16", "te_fp8_delayedscaling", "te_nvfp4", "mxfp4"], "bf16", 600)
    evals = {(c["arm"], c["against"]): c for c in out["comparisons"] if c["metric"] == "final_eval"}
    # bf16 x 3 arms, NVFP4 vs FP8, MXFP4 vs NVFP4.
    assert set(evals) == {("te_fp8_delayedscaling", "bf16"), ("te_nvfp4", "bf16"), ("mxfp4", "bf16"),
                          ("te_nvfp4", "te_fp8_delayedscaling"), ("mxfp4", "te_nvfp4")}
    assert all(c["holm_count"] == 5 for c in evals.values())
    assert stats.holm([c["p"] for c in evals.values()]) == [c["p_holm"] for c in evals.values()]
    assert evals[("te_nvfp4", "bf16")]["verdict"].startswith("higher")
    assert evals[("te_fp8_delayedscaling", "bf16")]["verdict"].startswith("equivalent within ±1%")
    assert evals[("mxfp4", "bf16")]["verdict"] == "not resolved at this scale"
    nv = evals[("te_nvfp4", "bf16")]
    assert nv["gap_percent"] == pytest.approx(5.0)
    assert nv["ci_t"][0] < nv["gap"] < nv["ci_t"][1]
    # The noise floor: RMS of the per-seed differences' sd over the comparisons to bf16.
    sds = [evals[(a, "bf16")]["sd"] for a in ("te_fp8_delayedscaling", "te_nvfp4", "mxfp4")]
    assert out["noise_floor"]["final_eval"] == pytest.approx(math.sqrt(sum(s * s for s in sds) / 3))


def test_gap_by_quarter_and_ranking_by_seed():
    ours = {0: _curve(lambda s: 2.0 + (0.02 if s > 300 else 0.0), 400)}
    theirs = {0: _curve(lambda s: 2.0, 400)}
    assert analysis.gap_by_segment(ours, theirs, 400) == pytest.approx([0.0, 0.0, 0.0, 1.0])
    per = {"a": {0: {"final_eval": 2.0}, 1: {"final_eval": 1.0}}, "b": {0: {"final_eval": 1.5}, 1: {"final_eval": 3.0}}}
    assert analysis.ranking_by_seed(per, "final_eval") == {0: [["b", 1.5], ["a", 2.0]], 1: [["a", 1.0], ["b", 3.0]]}
