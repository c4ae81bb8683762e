"""The lab under SIGTERM (in process, with training replaced by a stand-in that writes a run
directory), its provenance, and `--check` refusing a changed config before it trains."""

import json
import os
import signal

import pytest

from nvfp4_jax.cli import Exit
from nvfp4_jax.lab import __main__ as lab_main
from nvfp4_jax.lab import check, parse_arms, runs, study
from nvfp4_jax.lab.runs import StudyStopped

BASE = ["model_name=tiny", "steps=20", "eval_interval=10"]


def _fake_training(calls, *, signal_after=None, stopped=()):
    """A stand-in for runs.train_or_reuse: writes what a finished run leaves (metrics, summary)
    with losses that depend on the arm and seed; sends SIGTERM to this process after the run
    named `signal_after`; reports the runs named in `stopped` as stopped by a signal."""

    def train_or_reuse(cfg, run_dir, devices=None):
        name = cfg.train.run_name
        calls.append(name)
        if runs.is_finished(run_dir, cfg):
            return "reused"
        if name in stopped:
            return "stopped: SIGTERM"
        os.makedirs(run_dir, exist_ok=True)
        offset = 0.1 * (cfg.model.quantization != "bf16") + 0.01 * cfg.train.seed
        final = 2.5 + offset
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            for step in range(1, cfg.train.steps + 1):
                f.write(json.dumps({"step": step, "loss": 3.0 - step / 100 + offset}) + "\n")
            f.write(json.dumps({"step": cfg.train.steps, "eval_loss": final, "eval_loss_bf16": final - 0.01}) + "\n")
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump({"steps": cfg.train.steps, "final_eval_loss": final, "final_eval_loss_bf16": final - 0.01,
                       "stopped_by": None}, f)
        if name == signal_after:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives between this run and the next
        return "trained"

    return train_or_reuse


def _study(tmp_path, **kw):
    return study.run_study(BASE, parse_arms(["bf16", "te_nvfp4"]), seeds=2, out_dir=str(tmp_path),
                           make_plots=False, log=lambda _: None, **kw)


def test_sigterm_between_arms_stops_the_study_writes_what_it_has_and_a_rerun_resumes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runs, "train_or_reuse", _fake_training(calls, signal_after="te_nvfp4-seed0"))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StudyStopped) as stopped:
        _study(tmp_path)
    assert stopped.value.signal_name == "SIGTERM"
    assert calls == ["bf16-seed0", "te_nvfp4-seed0"]  # no further run started
    written = json.loads((tmp_path / "results.json").read_text())
    assert [(r["arm"], r["seed"]) for r in written["runs"]] == [("bf16", 0), ("te_nvfp4", 0)]
    # The lab's handler is gone with the study: the previous one is back.
    assert signal.getsignal(signal.SIGTERM) == before

    calls.clear()
    monkeypatch.setattr(runs, "train_or_reuse", _fake_training(calls))
    results = _study(tmp_path)
    assert calls == ["bf16-seed0", "te_nvfp4-seed0", "bf16-seed1", "te_nvfp4-seed1"]
    assert [r["status"] for r in results["runs"]] == ["reused", "reused", "trained", "trained"]
    assert [row["seeds"] for row in results["summary"]] == [[0, 1], [0, 1]]


def test_a_run_stopped_by_a_signal_stops_the_study_and_is_not_reported_as_trained(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runs, "train_or_reuse", _fake_training(calls, stopped={"te_nvfp4-seed0"}))
    messages = []
    with pytest.raises(StudyStopped):
        study.run_study(BASE, parse_arms(["bf16", "te_nvfp4"]), seeds=2, out_dir=str(tmp_path),
                        make_plots=False, log=messages.append)
    assert calls == ["bf16-seed0", "te_nvfp4-seed0"]
    written = json.loads((tmp_path / "results.json").read_text())
    assert [r["arm"] for r in written["runs"]] == ["bf16"]  # not "trained, final loss n/a"
    assert "te_nvfp4 seed 0: stopped by SIGTERM (checkpoint saved" in messages[1]
    assert "stopped by SIGTERM" in messages[-1] and "run the same command again" in messages[-1]


def test_the_command_exits_75_when_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "train_or_reuse", _fake_training([], signal_after="bf16-seed0"))
    code = lab_main.main([*BASE, "--arms", "bf16", "te_nvfp4", "--seeds", "1", "--out", str(tmp_path), "--no_plots"])
    assert code == 75


def test_results_record_provenance_configs_and_the_analysis(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "train_or_reuse", _fake_training([]))
    _study(tmp_path, extend=1.5)
    results = json.loads((tmp_path / "results.json").read_text())
    prov = results["study"]["provenance"]
    assert len(prov["commit"]) == 40 and isinstance(prov["dirty"], bool)
    assert prov["versions"]["jax"] and prov["versions"]["flax"] and prov["device"]["count"] >= 1
    configs = results["study"]["configs"]
    assert sorted(configs) == ["bf16-seed0", "bf16-seed1", "te_nvfp4-seed0", "te_nvfp4-seed1",
                               "te_nvfp4-x1.5-seed0", "te_nvfp4-x1.5-seed1"]
    assert configs["te_nvfp4-x1.5-seed1"]["train"]["steps"] == 30 and configs["bf16-seed0"]["train"]["steps"] == 20
    assert configs["bf16-seed0"]["train"]["eval_quantization"] == "both"  # the lab's default
    assert results["study"]["command"][:3] == ["python", "-m", "nvfp4_jax.lab"]
    # Extended runs feed tokens-to-target only.
    assert [r["arm"] for r in results["extended_runs"]] == ["te_nvfp4", "te_nvfp4"]
    assert [r["arm"] for r in results["runs"]] == ["bf16", "te_nvfp4", "bf16", "te_nvfp4"]
    gaps = {(c["metric"], c["arm"]): c for c in results["analysis"]["comparisons"]}
    assert gaps[("final_eval", "te_nvfp4")]["gap"] == pytest.approx(0.1)
    assert gaps[("final_eval_bf16", "te_nvfp4")]["gap"] == pytest.approx(0.1)
    assert gaps[("train_tail", "te_nvfp4")]["gap"] == pytest.approx(0.1)
    summary = (tmp_path / "summary.md").read_text()
    assert prov["commit"] in summary and "Seed-noise floor" in summary and "Holm" in summary
    assert "every seed" not in summary and "strongly" not in summary


def test_check_reports_a_changed_config_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runs, "train_or_reuse", _fake_training([]))
    _study(tmp_path)
    path = tmp_path / "results.json"
    results = json.loads(path.read_text())
    results["study"]["configs"]["bf16-seed0"]["train"]["learning_rate"] = 1e-4  # not what the command gives
    path.write_text(json.dumps(results))
    trained = []
    monkeypatch.setattr(runs, "train_or_reuse", lambda *a, **k: trained.append(a))
    assert lab_main.main(["--check", str(path), "--run", "bf16-seed0"]) == Exit.NOT_REPRODUCED == 6
    out = capsys.readouterr().out
    assert "train.learning_rate: 0.0001 -> 0.003" in out and "Not reproducible as recorded" in out
    assert trained == []
    # An unknown run is a user error naming the choices.
    assert lab_main.main(["--check", str(path), "--run", "nope"]) == 2
    assert "choose one of bf16-seed0" in capsys.readouterr().err


def test_check_compares_the_rerun_bit_for_bit(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runs, "train_or_reuse", _fake_training([]))
    _study(tmp_path)
    path = tmp_path / "results.json"
    assert check.check(str(path), which="te_nvfp4-seed1", log=print)
    assert "reproduces bit for bit" in capsys.readouterr().out
    results = json.loads(path.read_text())
    results["runs"][3]["final_eval_loss"] += 1e-7  # one ulp-ish change in the record
    # ... and in what the file derives from it, so that only the re-run can tell
    results.update({k: v for k, v in check.rederive(results, str(path)).items() if k != "train_tails"})
    path.write_text(json.dumps(results))
    assert not check.check(str(path), which="te_nvfp4-seed1", log=print)
    assert "does NOT reproduce: final_eval_loss" in capsys.readouterr().out


def _forge_tail(results):
    results["runs"][0]["train_tail"] -= 0.05


def _forge_summary(results):
    results["summary"][1]["train_tail_mean"] -= 0.05


def _forge_gap(results):
    row = next(c for c in results["analysis"]["comparisons"] if c["metric"] == "train_tail")
    row["gap"], row["verdict"] = 0.0, "equivalent within ±1% (TOST p < 0.05)"


def _drop_comparison(results):
    results["analysis"]["comparisons"].pop()


@pytest.mark.parametrize("forge, named", [
    (_forge_tail, "runs[0] (bf16-seed0).train_tail: recorded 2.7"),
    (_forge_summary, "summary[1].train_tail_mean: recorded"),
    (_forge_gap, ".gap: recorded 0.0 vs recomputed 0.1"),
    (_drop_comparison, "analysis.comparisons: recorded"),
])
def test_check_fails_on_derived_numbers_its_curves_do_not_give_and_names_them(
        tmp_path, monkeypatch, capsys, forge, named):
    # The curves and final losses are intact (a re-run would reproduce them bit for bit); what the
    # file derives from them (train tails, summary, analysis) was edited.
    monkeypatch.setattr(runs, "train_or_reuse", _fake_training([]))
    _study(tmp_path)
    path = tmp_path / "results.json"
    results = json.loads(path.read_text())
    forge(results)
    path.write_text(json.dumps(results))
    trained = []
    monkeypatch.setattr(runs, "train_or_reuse", lambda *a, **k: trained.append(a))
    assert lab_main.main(["--check", str(path), "--run", "te_nvfp4-seed1"]) == Exit.NOT_REPRODUCED
    out = capsys.readouterr().out
    assert "are not what its curves and final losses give" in out and named in out, out
    assert "Not reproducible as recorded" in out and "bit for bit" not in out
    assert trained == []  # refused before anything trains


def test_check_rederives_an_older_file_without_tokens_per_step_or_a_field_added_since(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "train_or_reuse", _fake_training([]))
    _study(tmp_path)
    path = str(tmp_path / "results.json")
    results = check.load_results(path)
    assert check.derived_differences(results, path) == []
    # a file from before study.tokens_per_step (taken from the configs and the device count) and
    # before length_to_match (empty here: no extended runs) still re-derives exactly
    results["study"].pop("tokens_per_step")
    assert results["analysis"].pop("length_to_match") == {}
    assert all(results["analysis"]["tokens_to_target"]["arms"]["bf16"]["tokens"].values())
    assert check.derived_differences(results, path) == []
    results["study"]["provenance"]["device"]["count"] = 4  # then tokens come out 4x: a difference
    assert {w for w, _, _ in check.derived_differences(results, path)} == {
        f"analysis.tokens_to_target.arms.bf16.tokens.{seed}" for seed in "01"}


def test_check_rederives_a_study_with_a_diverged_run_whose_curve_holds_nan(tmp_path, monkeypatch):
    # results.json writes a diverged run's NaN losses as "nan" (JSON has no NaN)
    monkeypatch.setattr(runs, "train_or_reuse", _fake_training([]))
    _study(tmp_path)
    path = str(tmp_path / "results.json")
    results = check.load_results(path)
    results["runs"][3].update(status="diverged: loss is nan at step 20", final_eval_loss=None,
                              final_eval_loss_bf16=None, loss_curve=[[10, 2.9], [20, "nan"]], train_tail="nan")
    fresh = check.rederive(results, path)
    assert fresh["train_tails"][3] == "nan"
    results.update(summary=fresh["summary"], analysis=fresh["analysis"])
    assert check.derived_differences(results, path) == []
    assert [c["seeds"] for c in results["analysis"]["comparisons"] if c["arm"] == "te_nvfp4"][0] == [0]


@pytest.mark.parametrize("key", ["summary", "analysis"])
def test_check_on_results_without_its_derived_numbers_names_the_field_and_exits_2(tmp_path, monkeypatch, capsys, key):
    monkeypatch.setattr(runs, "train_or_reuse", _fake_training([]))
    _study(tmp_path)
    path = tmp_path / "results.json"
    results = json.loads(path.read_text())
    results.pop(key)
    path.write_text(json.dumps(results))
    assert lab_main.main(["--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and f"has no `{key}` field" in err
