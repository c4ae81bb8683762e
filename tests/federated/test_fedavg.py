"""FedAvg is FLARE's own weighted mean, weighted by the samples each site reports."""

import numpy as np
import pytest

pytest.importorskip("nvflare")


def test_fedavg_of_known_updates_is_the_weighted_mean_exactly():
    from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper

    helper = WeightedAggregationHelper()
    # Site 1 moved every weight by +1 over 10 samples, site 2 by +3 over 30: (10 + 90) / 40 = 2.5.
    helper.add(data={"w": np.full((4,), 1.0, np.float32)}, weight=10, contributor_name="site-1", contribution_round=0)
    helper.add(data={"w": np.full((4,), 3.0, np.float32)}, weight=30, contributor_name="site-2", contribution_round=0)
    result = helper.get_result()
    assert np.array_equal(result["w"], np.full((4,), 2.5, np.float32))


def test_a_failed_site_is_left_out_of_the_round():
    from nvflare.app_common.abstract.fl_model import FLModel

    from nvfp4_jax.federated.server import BudgetedFedAvg

    ctrl = BudgetedFedAvg(run_config={}, site_names=["site-1", "site-2"], num_rounds=1,
                          budget_policy={"name": "equal", "total_samples": 4, "quantum": 2})
    # An empty result (what FLARE delivers for a site whose script raised) is recorded as a
    # failure and never reaches the aggregator.
    assert ctrl._aggregate_one_result(FLModel(params={}, meta={"client_name": "site-2"})) is False
    assert ctrl._reports == {"site-2": {"failed": True}}


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_update_is_refused_not_averaged(bad):
    from nvflare.app_common.abstract.fl_model import FLModel

    from nvfp4_jax.federated.server import META_KEY, BudgetedFedAvg

    ctrl = BudgetedFedAvg(run_config={}, site_names=["site-1", "site-2"], num_rounds=1,
                          budget_policy={"name": "equal", "total_samples": 4, "quantum": 2},
                          update_contract={"kind": "diff"})
    ctrl._reports = {}
    report = {"samples": 2, "steps": 1, "seconds": 0.1, "payload_bytes": 16, "train_loss": 1.0}
    update = {"w": np.array([0.1, bad, 0.2, 0.3], np.float32)}
    assert ctrl._aggregate_one_result(FLModel(params=update, meta={"client_name": "site-1", META_KEY: report})) is False
    assert ctrl._reports == {"site-1": {"failed": True, "error": "non-finite update (NaN or Inf)"}}


def test_a_site_with_a_non_finite_update_sends_nothing_and_resets_its_residual():
    from types import SimpleNamespace

    from nvfp4_jax.federated import client

    def train_round(params, budget, schedule_window=None):
        return SimpleNamespace(params={"w": np.array([np.nan, 1.0], np.float32)}, samples=budget, steps=1,
                               seconds=0.1, joules=None, train_loss=1.0)

    # The residual of earlier rounds' fp8 compression error: it must not absorb the NaN.
    state = {"trainer": SimpleNamespace(train_round=train_round), "residual": {"w": np.ones(2, np.float32)}}
    spec = {"round": 3, "contract": {"kind": "diff", "compression": "fp8"}, "budgets": {"site-1": 2}}
    received = SimpleNamespace(params={"w": np.zeros(2, np.float32)})
    with pytest.raises(RuntimeError, match="not finite"):
        client._train_round(SimpleNamespace(crash_in_round=0), "site-1", spec, received, state)
    assert state["residual"] is None


def _controller(**kw):
    from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper

    from nvfp4_jax.federated.server import BudgetedFedAvg

    ctrl = BudgetedFedAvg(run_config={}, site_names=["site-1", "site-2"], num_rounds=3,
                          budget_policy={"name": "equal", "total_samples": 4, "quantum": 2},
                          update_contract={"kind": "diff"}, **kw)
    # The round state FLARE's FedAvg.run sets up before a round's results arrive.
    ctrl._aggr_helper, ctrl._aggr_metrics_helper = WeightedAggregationHelper(), WeightedAggregationHelper()
    ctrl._all_metrics, ctrl._site_metric_weights, ctrl._params_type = True, {}, None
    ctrl._received_count, ctrl._expected_count, ctrl.current_round = 0, 2, 0
    ctrl._reports = {}
    return ctrl


@pytest.mark.parametrize("weighting, want", [
    # site-1: +1 over 100 tokens of data, 30 samples this round; site-2: +3 over 300 tokens, 10 samples.
    ("data", (100 * 1 + 300 * 3) / 400),
    ("samples", (30 * 1 + 10 * 3) / 40),
])
def test_fedavg_weights_each_site_by_its_data_or_by_its_round_samples(weighting, want):
    from nvflare.app_common.abstract.fl_model import FLModel

    from nvfp4_jax.federated.server import META_KEY

    ctrl = _controller(weighting=weighting)
    for site, delta, tokens, samples in (("site-1", 1.0, 100, 30), ("site-2", 3.0, 300, 10)):
        report = {"samples": samples, "steps": 1, "seconds": 0.1, "payload_bytes": 16, "train_loss": 1.0,
                  "data_tokens": tokens}
        # What the site itself sets; the server decides the weight.
        meta = {"client_name": site, "NUM_STEPS_CURRENT_ROUND": samples, META_KEY: report}
        assert ctrl._aggregate_one_result(FLModel(params={"w": np.full(4, delta, np.float32)}, meta=meta))
    np.testing.assert_allclose(ctrl._aggr_helper.get_result()["w"], np.full(4, want), rtol=1e-6)
    assert ctrl._reports["site-2"]["weight"] == (300 if weighting == "data" else 10)


def test_a_round_in_which_every_site_failed_keeps_the_last_good_model_and_ends_the_job(tmp_path, capsys):
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from nvfp4_jax.federated import __main__ as cli

    ctrl = _controller(output_dir=str(tmp_path))
    ctrl._history = [{"round": 0, "validation_loss": 5.0, "budgets": None}]  # load_model's record
    good = FLModel(params={"w": np.arange(4, dtype=np.float32)}, params_type=ParamsType.FULL)
    for site in ("site-1", "site-2"):
        assert ctrl._aggregate_one_result(FLModel(params={}, meta={"client_name": site})) is False
    # FLARE's mean of no results is an empty model; the server keeps the one it had.
    model = ctrl.update_model(good, FLModel(params={}, params_type=None))
    assert model is good and ctrl.ended_in_round == 1
    ctrl.save_model(model)
    saved = np.load(tmp_path / "global_model.npz")
    np.testing.assert_array_equal(saved["w"], good.params["w"])
    # The later rounds send nothing, record nothing and leave the saved model alone.
    assert ctrl.send_model(data=good) is None
    assert ctrl.update_model(good, FLModel(params={}, params_type=None)) is good
    (tmp_path / "global_model.npz").unlink()
    ctrl.save_model(good)
    assert not (tmp_path / "global_model.npz").exists()
    ended = cli._ended(str(tmp_path))
    assert ended.startswith("every site failed in round 1") and "round 0's" in ended
    assert str(tmp_path / "global_model.npz") in ended


def test_a_round_s_makespan_is_its_wall_time_beside_the_slowest_site_s_busy_time(monkeypatch):
    import time
    from types import SimpleNamespace

    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from nvfp4_jax.federated import server

    ctrl = _controller()
    ctrl._history = [{"round": 0, "validation_loss": 5.0, "budgets": None}]
    ctrl._evaluator = SimpleNamespace(scores=lambda params: {"validation_loss": 4.0})  # the server's evaluation, stood in
    monkeypatch.setattr(server.FedAvg, "update_model", lambda self, model, aggr: aggr)  # FLARE's update
    ctrl._reports = {"site-1": {"seconds": 0.1, "samples": 2}, "site-2": {"seconds": 0.3, "samples": 2}}
    ctrl._budgets = [2, 2]
    ctrl._round_start = time.perf_counter() - 2.0  # the broadcast went out 2 s ago
    ctrl.update_model(None, FLModel(params={"w": np.zeros(2, np.float32)}, params_type=ParamsType.FULL))
    record = ctrl._history[-1]
    assert 2.0 <= record["makespan_s"] < 10.0  # FLARE's dispatch and polling count
    assert record["compute_makespan_s"] == 0.3
    assert record["idle_s"]["site-1"] == pytest.approx(record["makespan_s"] - 0.1)
    assert "(compute 0.30 s)" in server.round_line(record, 3)
    assert "devices" not in server.round_line(record, 3)
    # A silo with per-device shares: its devices' microbatches a step in the line.
    record["sites"]["site-2"]["silo"] = {"trained_with": [3, 1]}
    assert " | devices site-2=3:1" in server.round_line(record, 3)
