"""Bad input to the lab is one `error:` line with exit 2 (never a traceback, never exit 1, which
means "does not reproduce"): a metrics.jsonl line that is not JSON, and a results.json missing a
field that --check or --analyze needs. Nothing here trains: results files are written by hand."""

import json
import os

import pytest

from nvfp4_jax.lab import __main__ as lab_main
from nvfp4_jax.lab import runs

BASE = ["model_name=tiny", "steps=20", "eval_interval=10"]


def _results(tmp_path, **study_changes):
    """A complete two-arm, two-seed results.json (as `run_study` writes it), with `study_changes`
    applied (None removes a key)."""
    study = {"steps": 20, "seeds": [0, 1], "reference": "bf16", "base_args": list(BASE),
             "arms": [{"name": "bf16", "spec": "bf16"}, {"name": "te_nvfp4", "spec": "te_nvfp4"}],
             "curve_window": 10}
    for key, value in study_changes.items():
        if value is None:
            study.pop(key)
        else:
            study[key] = value
    runs_ = [{"arm": arm, "seed": seed, "status": "trained", "steps": 20, "extended": False,
              "run_directory": f"runs/{arm}-seed{seed}",
              "loss_curve": [[10, 3.0 + 0.1 * (arm != "bf16")], [20, 2.8 + 0.1 * (arm != "bf16") + 0.01 * seed]],
              "final_eval_loss": 2.5 + 0.1 * (arm != "bf16") + 0.01 * seed, "final_eval_loss_bf16": None}
             for seed in (0, 1) for arm in ("bf16", "te_nvfp4")]
    return {"study": study, "runs": runs_, "extended_runs": []}


def _write(tmp_path, results):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    return str(path)


def _one_error_line(capsys):
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def test_a_metrics_line_that_is_not_json_is_one_error_line_naming_the_file_and_line(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "runs" / "bf16-seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\nnot json at all\n{"step": 2, "loss": 2.9}\n')
    monkeypatch.setattr(runs, "train_or_reuse", lambda cfg, run_dir, devices=None: "reused")
    code = lab_main.main([*BASE, "--arms", "bf16", "--seeds", "1", "--out", str(tmp_path), "--no_plots"])
    assert code == 2
    line = _one_error_line(capsys)
    assert os.path.join(str(run_dir), "metrics.jsonl") in line and "line 2 is not a JSON record" in line


@pytest.mark.parametrize("where, field", [("study", "base_args"), ("run", "run_directory"),
                                          ("run", "arm"), ("run", "seed"), ("study", "arms")])
def test_check_on_results_missing_a_field_names_it_and_exits_2(tmp_path, monkeypatch, capsys, where, field):
    results = _results(tmp_path)
    if where == "study":
        results["study"].pop(field)
    else:
        results["runs"][1].pop(field)
    trained = []
    monkeypatch.setattr(runs, "train_or_reuse", lambda *a, **k: trained.append(a))
    assert lab_main.main(["--check", _write(tmp_path, results)]) == 2
    line = _one_error_line(capsys)
    assert f"has no `{field}` field" in line
    assert ("study has no" in line) if where == "study" else ("runs[1]" in line)
    assert trained == []


def test_analyze_reads_a_complete_results_file(tmp_path, capsys):
    out = tmp_path / "stats.json"
    assert lab_main.main(["--analyze", _write(tmp_path, _results(tmp_path)), "--stats_out", str(out)]) == 0
    rows = json.loads(out.read_text())["analysis"]["comparisons"]
    assert {(r["metric"], r["arm"], r["against"]) for r in rows} == {
        ("final_eval", "te_nvfp4", "bf16"), ("train_tail", "te_nvfp4", "bf16")}


def _drop(results, key, run=None):
    (results["study"] if run is None else results["runs"][run]).pop(key)


@pytest.mark.parametrize("change, expected", [
    (lambda r: _drop(r, "arms"), "study has no `arms` field"),
    (lambda r: _drop(r, "steps"), "study has no `steps` field"),
    (lambda r: _drop(r, "reference"), "study has no `reference` field"),
    (lambda r: _drop(r, "arm", run=2), "runs[2] (bf16-seed1) has no `arm` field"),
    (lambda r: _drop(r, "seed", run=3), "runs[3] (te_nvfp4-seed1) has no `seed` field"),
    (lambda r: r["study"].update(steps="600"), "study.steps is '600'"),
    (lambda r: r["study"].update(arms=[]), "study.arms is []"),
    (lambda r: r.update(runs=[]), "`runs` is empty"),
    (lambda r: r["runs"][3].update(arm="mxfp4"), "runs[3] (te_nvfp4-seed1) has arm 'mxfp4', which is not in study.arms"),
    (lambda r: _drop(r, "final_eval_loss", run=1), "runs[1] (te_nvfp4-seed0) has no `final_eval_loss`"),
    (lambda r: r["runs"][1].update(final_eval_loss=None), "runs[1] (te_nvfp4-seed0) has no `final_eval_loss`"),
    (lambda r: r["runs"][2].update(loss_curve=[]), "runs[2] (bf16-seed1) has an empty or missing `loss_curve`"),
    (lambda r: _drop(r, "loss_curve", run=0), "runs[0] (bf16-seed0) has an empty or missing `loss_curve`"),
    (lambda r: r["runs"][1].update(final_eval_loss="2.5"),
     "runs[1] (te_nvfp4-seed0).final_eval_loss is '2.5': it must be a number or null"),
    (lambda r: r["runs"][0]["loss_curve"].append([30]),
     "runs[0] (bf16-seed0).loss_curve[2] is [30]: it must be a [step, loss] pair of numbers"),
    (lambda r: r["runs"][0]["loss_curve"].append(["30", 2.7]), "runs[0] (bf16-seed0).loss_curve[2] is ['30', 2.7]"),
    (lambda r: r["runs"][2].update(loss_curve={"10": 3.0}), "runs[2] (bf16-seed1).loss_curve is {'10': 3.0}"),
    (lambda r: r.update(runs=[x for x in r["runs"] if x["arm"] != "bf16"]),
     "study.reference is 'bf16', but no run of that arm is recorded"),
])
def test_analyze_refuses_a_missing_field_naming_it_and_the_run(tmp_path, capsys, change, expected):
    results = _results(tmp_path)
    change(results)
    out = tmp_path / "stats.json"
    assert lab_main.main(["--analyze", _write(tmp_path, results), "--stats_out", str(out)]) == 2
    assert expected in _one_error_line(capsys)
    assert not out.exists()


def test_analyze_accepts_a_diverged_run_without_final_loss_and_a_study_without_reference(tmp_path, capsys):
    results = _results(tmp_path)
    results["runs"][1].update(status="diverged: loss is nan at step 7", final_eval_loss=None, loss_curve=[])
    results["study"]["reference"] = None
    out = tmp_path / "stats.json"
    assert lab_main.main(["--analyze", _write(tmp_path, results), "--stats_out", str(out)]) == 0


# --- a finished run read back is checked against its files ---------------------------------------


def _finished_study(tmp_path, monkeypatch):
    """The one-run study's files as a finished run leaves them (20 loss records, the final
    evaluation, the summary), and the lab's training replaced by a recorder: the lab must read
    the run back, or refuse it, without training."""
    run_dir = tmp_path / "runs" / "bf16-seed0"
    run_dir.mkdir(parents=True)
    metrics = run_dir / "metrics.jsonl"
    with open(metrics, "w") as f:
        for step in range(1, 21):
            f.write(json.dumps({"step": step, "loss": 3.0 - step / 100, "segment": 0}) + "\n")
        f.write(json.dumps({"step": 20, "eval_loss": 2.6, "eval_loss_bf16": 2.6, "segment": 0}) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(
        {"steps": 20, "step_reached": 20, "stopped_by": None, "final_train_loss": 2.8,
         "final_eval_loss": 2.6, "final_eval_loss_bf16": 2.6}))
    calls = []
    from nvfp4_jax.train import loop

    monkeypatch.setattr(loop, "run", lambda cfg, **kw: calls.append(cfg.train.run_name) or {})
    args = [*BASE, "--arms", "bf16", "--seeds", "1", "--out", str(tmp_path), "--no_plots"]
    return args, calls, metrics


def _lines(path):
    return path.read_text().splitlines(keepends=True)


@pytest.mark.parametrize("damage, expected", [
    (lambda p: p.unlink(), "metrics.jsonl is missing"),
    (lambda p: p.write_text("".join(_lines(p)[:6] + _lines(p)[7:])), "no training-loss record of step 7 (1 of the 20 steps)"),
    (lambda p: p.write_text("".join(_lines(p)[:-1]) + _lines(p)[-1][:15]),
     "the last line of metrics.jsonl is cut short; metrics.jsonl has no final evaluation record (step 20)"),
    (lambda p: p.write_text("".join(_lines(p)[:-1])), "no final evaluation record (step 20)"),
    (lambda p: p.write_text("".join(_lines(p)[:-1]) + json.dumps({"step": 20, "eval_loss": 9.0}) + "\n"),
     "the summary's final_eval_loss 2.6 is not metrics.jsonl's 9.0 at step 20"),
    (lambda p: p.write_text("".join(_lines(p)[:3]) + "{oops\n" + "".join(_lines(p)[3:])), "line 4 is not a JSON record"),
    (lambda p: p.write_text(p.read_text().replace('"loss": 2.8,', '"loss": 2.5,')),
     "the summary's final_train_loss 2.8 is not metrics.jsonl's 2.5 at step 20"),
])
def test_a_finished_run_whose_files_do_not_bear_out_its_summary_is_refused_naming_it(
        tmp_path, monkeypatch, capsys, damage, expected):
    args, calls, metrics = _finished_study(tmp_path, monkeypatch)
    damage(metrics)
    assert lab_main.main(args) == 2
    line = _one_error_line(capsys)
    assert "the finished run bf16-seed0 cannot be reused" in line and expected in line
    assert "Remove that directory to train it again" in line
    assert calls == []  # refused before anything trains (or is read back)


def test_an_intact_finished_run_is_reused(tmp_path, monkeypatch):
    args, calls, _ = _finished_study(tmp_path, monkeypatch)
    assert lab_main.main(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["status"] for r in results["runs"]] == ["reused"] and calls == []
    assert results["runs"][0]["final_eval_loss"] == 2.6
