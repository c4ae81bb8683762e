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
