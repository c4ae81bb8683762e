"""The lab's parts without training: statistics, arm specs, reading run directories, the report."""

import json
import math
import os
import sys

import pytest

from nvfp4_jax.config import ConfigError, load_config, save_json
from nvfp4_jax.lab import plots, report, runs, stats
from nvfp4_jax.lab.arms import DEFAULT_ARMS, arm_config, parse_arm, parse_arms
from nvfp4_jax.config import config_layers

# --- statistics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.5, 12.7062, 100.0])
def test_t_p_values_match_the_closed_forms_for_one_and_two_degrees_of_freedom(t):
    # df=1 (Cauchy): P(|T| >= t) = 1 - 2/pi atan(t); df=2: 1 - t / sqrt(t^2 + 2).
    assert stats.t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-12)
    assert stats.t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(t * t + 2), abs=1e-12)


def test_t_p_values_match_printed_tables():
    # Two-sided 5% critical values of Student's t (any statistics table).
    for df, critical in ((4, 2.776445), (10, 2.228139), (30, 2.042272)):
        assert stats.t_two_sided_p(critical, df) == pytest.approx(0.05, abs=2e-6)


def test_welch_and_paired_by_hand():
    a, b = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]
    w = stats.welch(a, b)
    # Equal variances 1 and n = 3: t = -3 / sqrt(2/3), df = 4.
    assert w.t == pytest.approx(-3 / math.sqrt(2 / 3))
    assert w.df == pytest.approx(4.0)
    assert w.p == pytest.approx(stats.t_two_sided_p(3 / math.sqrt(2 / 3), 4))
    p = stats.paired([1.0, 2.0, 4.0], [0.0, 1.0, 2.0])  # differences 1, 1, 2
    assert p.t == pytest.approx((4 / 3) / (math.sqrt(1 / 3) / math.sqrt(3)))
    assert p.df == 2
    assert stats.welch([1.0], [2.0, 3.0]).p is None
    assert stats.std([2.0]) is None and stats.std([1.0, 3.0]) == pytest.approx(math.sqrt(2))


def test_fractional_degrees_of_freedom_against_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for t, df in ((0.7, 1.3), (2.1, 2.6), (5.0, 3.9), (1.5, 17.2)):
        assert stats.t_two_sided_p(t, df) == pytest.approx(2 * scipy_stats.t.sf(t, df), rel=1e-10)


# --- arms ---------------------------------------------------------------------------------------


def test_arm_specs_parse_and_bad_ones_name_the_problem():
    arm = parse_arm("ends:quantization=te_nvfp4, bf16_first_layers=1")
    assert arm.name == "ends" and arm.overrides == (("quantization", "te_nvfp4"), ("bf16_first_layers", "1"))
    assert parse_arm(arm.spec) == arm
    for bad, message in (
        ("a b:steps=1", "must match"),
        ("x:steps", "expected key=value"),
        ("x:seed=3", "seed is set by the lab"),
        ("x:steps=1,steps=2", "steps given more than once"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_arm(bad)
    with pytest.raises(ConfigError, match="repeated: te_nvfp4"):
        parse_arms(["te_nvfp4", "te_nvfp4:learning_rate=1e-3"])


def test_default_arms_are_the_papers_comparisons(tmp_path):
    base = config_layers(["steps=600"])
    configs = {arm.name: arm_config(base, arm, 4, str(tmp_path)) for arm in parse_arms(DEFAULT_ARMS)}
    assert {n: c.model.quantization for n, c in configs.items()} == {
        "bf16": "bf16", "te_fp8_delayedscaling": "te_fp8_delayedscaling", "te_nvfp4": "te_nvfp4",
        "te_nvfp4_no_rht": "te_nvfp4_no_rht", "nvfp4_no_sr": "nvfp4_no_sr",
        "nvfp4_1d_weights": "nvfp4_1d_weights", "mxfp4": "mxfp4",
        "mxfp4_nvfp4_recipe": "mxfp4_nvfp4_recipe",
        "te_nvfp4_bf16_ends": "te_nvfp4", "te_nvfp4_bf16_tail": "te_nvfp4",
    }
    ends, tail = configs["te_nvfp4_bf16_ends"], configs["te_nvfp4_bf16_tail"]
    assert (ends.model.bf16_first_layers, ends.model.bf16_last_layers) == (1, 1)
    assert tail.train.quantization_end_step == 480  # 80% of 600
    assert all(c.train.quantization_end_step == -1 for n, c in configs.items() if n != "te_nvfp4_bf16_tail")
    # The lab's keys: the seed, and one directory per arm and seed.
    assert {c.train.seed for c in configs.values()} == {4}
    assert configs["mxfp4"].train.run_name == "mxfp4-seed4"
    assert configs["mxfp4"].train.base_output_directory == str(tmp_path)


def test_arm_keys_are_validated_like_any_config(tmp_path):
    base = config_layers([])
    with pytest.raises(ConfigError, match="Did you mean 'learning_rate'"):
        arm_config(base, parse_arm("x:learning_rat=1"), 0, str(tmp_path))
    with pytest.raises(ConfigError, match="only quantization_end_step take a percentage"):
        arm_config(base, parse_arm("x:steps=50%"), 0, str(tmp_path))


# --- run directories ----------------------------------------------------------------------------


def test_metrics_are_read_tolerantly(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "loss": 5.0, "grad_norm": 1.0, "some_new_field": [1, 2]},
        {"segment": 2, "note": "resumed"},  # a record of a kind the lab does not know
        {"step": 2, "loss": 4.0},
        {"step": 2, "eval_loss": 4.5},
        {"step": 2, "quant_stats": {"layers_0/mlp/up": {"x": {"error": 0.1}}}},
        {"step": 2, "loss": 3.9},  # the resumed run logged step 2 again: the last one counts
    ]
    path.write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 3, "lo')  # cut by a kill
    got = runs.metric_series(str(tmp_path))
    assert got["loss"] == {1: 5.0, 2: 3.9}
    assert got["eval_loss"] == {2: 4.5}
    assert got["quant_stats"] == {2: {"layers_0/mlp/up": {"x": {"error": 0.1}}}}


def test_a_directory_with_another_config_is_refused_and_the_same_config_is_reused(tmp_path):
    cfg = load_config(["steps=5", f"base_output_directory={tmp_path}", "run_name=a"])
    run_dir = tmp_path / "a"
    run_dir.mkdir()
    save_json(cfg, str(run_dir / "config.json"))
    runs.check_reusable(str(run_dir), cfg)  # same config: fine
    moved = load_config(["steps=5", "base_output_directory=/elsewhere", "run_name=b"])
    runs.check_reusable(str(run_dir), moved)  # only the location differs: fine
    with pytest.raises(runs.LabError, match=r"train.steps: 5 -> 6.*remove that directory"):
        runs.check_reusable(str(run_dir), load_config(["steps=6"]))
    assert not runs.is_finished(str(run_dir), cfg)
    (run_dir / "summary.json").write_text(json.dumps({"steps": 5, "final_eval_loss": 2.0, "extra": 1}))
    assert runs.is_finished(str(run_dir), cfg)
    (run_dir / "summary.json").write_text('{"steps": 5, "final_')  # killed while writing
    assert not runs.is_finished(str(run_dir), cfg)


def test_read_run_windows_the_loss_curve(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 8):
            f.write(json.dumps({"step": step, "loss": float(step)}) + "\n")
        f.write(json.dumps({"step": 7, "eval_loss": 1.5}) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps(
        {"final_eval_loss": 1.5, "median_tokens_per_second_per_device": 100.0}))
    got = runs.read_run(str(tmp_path), curve_window=3)
    assert got["loss_curve"] == [[3, 2.0], [6, 5.0], [7, 7.0]]
    assert got["eval_losses"] == [[7, 1.5]] and got["final_eval_loss"] == 1.5
    assert got["tokens_per_second_per_device"] == 100.0 and got["quant_stats"] is None


# --- report -------------------------------------------------------------------------------------


def _runs(table):
    return [{"arm": arm, "seed": seed, "final_eval_loss": loss, "tokens_per_second_per_device": 10.0}
            for arm, losses in table.items() for seed, loss in enumerate(losses)]


def test_summary_gaps_and_tests_by_hand():
    rows = report.summarize(["bf16", "fp4", "half"], _runs({
        "bf16": [2.0, 2.1, 2.2], "fp4": [2.1, 2.3, 2.3], "half": [2.05],
    }), "bf16")
    ref, fp4, half = rows
    assert ref["mean"] == pytest.approx(2.1) and ref["std"] == pytest.approx(0.1) and "gap_nats" not in ref
    assert fp4["gap_nats"] == pytest.approx(0.1333333333)
    assert fp4["gap_percent"] == pytest.approx(100 * 0.1333333333 / 2.1)
    # Per-seed differences 0.1, 0.2, 0.1.
    assert fp4["paired_gap_mean"] == pytest.approx(0.1333333333)
    assert fp4["paired_gap_std"] == pytest.approx(math.sqrt(1 / 300))
    assert fp4["welch_p"] == pytest.approx(stats.welch([2.1, 2.3, 2.3], [2.0, 2.1, 2.2]).p)
    # No uncorrected verdict in the rows: the conclusions come from analysis (Holm, TOST).
    assert "beyond_seed_noise" not in fp4
    # An arm with fewer seeds is compared with the reference on its own seeds only.
    assert half["gap_seeds"] == [0] and half["gap_nats"] == pytest.approx(0.05)
    assert half["welch_p"] is None


def test_summary_markdown_has_a_row_per_arm_and_states_the_test():
    study = {"steps": 10, "seeds": [0, 1, 2], "reference": "bf16", "base_args": ["tiny.yml"],
             "seed_note": "Seeds.", "arms": [], "plots": ["loss_curves.png"]}
    rows = report.summarize(["bf16", "fp4"], _runs({"bf16": [2.0, 2.1, 2.2], "fp4": [2.1, 2.3, 2.3]}), "bf16")
    text = report.summary_markdown(study, rows)
    assert "| `bf16` | 3 | 2.1000 ± 0.1000 | n/a ± n/a | n/a ± n/a | (reference) |" in text
    assert "| `fp4` | 3 | 2.2333 ± 0.1155 | n/a ± n/a | n/a ± n/a | +0.1333 | +6.35 |" in text
    assert "uncorrected" in text and "Plots: loss_curves.png." in text


def test_without_matplotlib_plots_are_skipped_with_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    files, note = plots.make_plots({"summary": [], "runs": []}, "/nonexistent", "bf16")
    assert files == [] and "pip install 'nvfp4_jax[plot]'" in note


def test_default_comparisons_separate_the_format_from_the_recipe():
    from nvfp4_jax.lab.analysis import default_comparisons

    names = [parse_arm(a).name for a in DEFAULT_ARMS]
    pairs = default_comparisons(names, "bf16")
    assert [p for p in pairs if p[1] == "bf16"] == [(a, "bf16") for a in names if a != "bf16"]
    assert ("te_nvfp4", "te_fp8_delayedscaling") in pairs
    # The same recipe in two formats (the format's effect) and one format under two recipes.
    assert ("mxfp4_nvfp4_recipe", "te_nvfp4") in pairs and ("mxfp4", "te_nvfp4") in pairs
    assert ("mxfp4_nvfp4_recipe", "mxfp4") in pairs
    assert len(pairs) == len(set(pairs))
    assert default_comparisons(["bf16", "mxfp4"], "bf16") == [("mxfp4", "bf16")]
