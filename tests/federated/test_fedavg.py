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

    def train_round(params, budget):
        return SimpleNamespace(params={"w": np.array([np.nan, 1.0], np.float32)}, samples=budget, steps=1,
                               seconds=0.1, joules=None, train_loss=1.0)

    # The residual of earlier rounds' fp8 compression error: it must not absorb the NaN.
    state = {"trainer": SimpleNamespace(train_round=train_round), "residual": {"w": np.ones(2, np.float32)}}
    spec = {"round": 3, "contract": {"kind": "diff", "compression": "fp8"}, "budgets": {"site-1": 2}}
    received = SimpleNamespace(params={"w": np.zeros(2, np.float32)})
    with pytest.raises(RuntimeError, match="not finite"):
        client._train_round(SimpleNamespace(crash_in_round=0), "site-1", spec, received, state)
    assert state["residual"] is None
