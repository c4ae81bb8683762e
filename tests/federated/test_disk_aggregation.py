"""`--disk-offload`: FedAvg's running sum in memory-mapped files, the same mean as FLARE's in memory."""

import os
import tracemalloc

import numpy as np
import pytest

pytest.importorskip("nvflare")


def _updates(sites=3, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"embed": (64, 33), "layer/kernel": (17, 5, 3), "scale": (), "bias": (7,)}
    return [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(sites)]


def _helper_mean(updates, weights):
    from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper

    helper = WeightedAggregationHelper()
    for i, (u, w) in enumerate(zip(updates, weights)):
        helper.add(data=u, weight=w, contributor_name=f"site-{i + 1}", contribution_round=0)
    return helper.get_result()


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 100])  # one chunk a leaf; many, with a remainder
def test_the_disk_mean_is_bit_identical_to_flares_in_memory_mean(tmp_path, chunk_bytes):
    from nvfp4_jax.federated.disk_aggregation import DiskWeightedAggregator

    updates, weights = _updates(), [3.0, 1.7, 11.0]
    aggregator = DiskWeightedAggregator(root=str(tmp_path), chunk_bytes=chunk_bytes)
    for i, (u, w) in enumerate(zip(updates, weights)):
        aggregator.add(u, w, f"site-{i + 1}")
    mean = aggregator.mean()
    expected = _helper_mean(updates, weights)
    assert sorted(mean) == sorted(expected)
    for k in expected:
        assert mean[k].dtype == expected[k].dtype and mean[k].shape == expected[k].shape
        assert np.array_equal(mean[k], expected[k]), k  # bit-exact: the same operations in the same order


def test_the_running_sum_is_model_sized_files_that_last_only_the_round(tmp_path):
    from nvflare.apis.fl_constant import FLMetaKey
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from nvfp4_jax.federated.disk_aggregation import DiskWeightedAggregator

    updates = _updates(2)
    model_bytes = sum(v.nbytes for v in updates[0].values())
    aggregator = DiskWeightedAggregator(root=str(tmp_path))
    aggregator.reset_stats()
    for i, u in enumerate(updates):
        aggregator.accept_model(FLModel(params=u, params_type=ParamsType.DIFF,
                                        meta={"client_name": f"site-{i + 1}", FLMetaKey.NUM_STEPS_CURRENT_ROUND: 2.0}))
        files = [os.path.join(aggregator.directory, f) for f in os.listdir(aggregator.directory)]
        assert len(files) == len(u) and sum(os.path.getsize(f) for f in files) == model_bytes
    directory = aggregator.directory
    result = aggregator.aggregate_model()
    assert result.params_type == ParamsType.DIFF
    assert np.array_equal(result.params["embed"], _helper_mean(updates, [2.0, 2.0])["embed"])
    assert not os.path.exists(directory) and aggregator.directory is None
    assert aggregator.last_round_bytes == model_bytes


def test_adding_an_update_holds_one_chunk_not_a_model_sized_sum(tmp_path):
    from nvfp4_jax.federated.disk_aggregation import DiskWeightedAggregator

    update = {"w": np.ones((1 << 20,), np.float32)}  # 4 MB
    aggregator = DiskWeightedAggregator(root=str(tmp_path), chunk_bytes=64 << 10)
    aggregator.add(update, 1.0)
    tracemalloc.start()
    aggregator.add(update, 2.0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 * (64 << 10), peak  # FLARE's `total + v * w` allocates two 4 MB arrays here
    assert np.array_equal(aggregator.mean()["w"], np.ones((1 << 20,), np.float32))


def test_updates_added_on_two_threads_are_both_summed(tmp_path):
    import threading

    from nvfp4_jax.federated.disk_aggregation import DiskWeightedAggregator

    # Small integers: every sum is exact in float32 in any order, so a lost update would show.
    aggregator = DiskWeightedAggregator(root=str(tmp_path), chunk_bytes=64)
    threads = [threading.Thread(target=aggregator.add, args=({"w": np.full((50_000,), float(i), np.float32)}, 1.0))
               for i in (1, 2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert np.array_equal(aggregator.mean()["w"], np.full((50_000,), 2.5, np.float32))


def test_an_update_of_another_shape_is_one_line_error(tmp_path):
    from nvfp4_jax.federated.disk_aggregation import DiskWeightedAggregator

    aggregator = DiskWeightedAggregator(root=str(tmp_path))
    aggregator.add({"w": np.ones((3,), np.float32)}, 1.0, "site-1")
    with pytest.raises(ValueError, match=r"site-2's w has shape \(4,\), the round's sum \(3,\)"):
        aggregator.add({"w": np.ones((4,), np.float32)}, 1.0, "site-2")
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        DiskWeightedAggregator(chunk_bytes=0)


def _round(ctrl, results):
    """What FedAvg's `run` does around one round's callbacks: reset, one callback a result, the mean."""
    from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper

    ctrl.current_round, ctrl._received_count, ctrl._expected_count = 0, 0, len(results)
    ctrl._params_type, ctrl._site_metric_weights, ctrl._reports = None, {}, {}
    if ctrl.aggregator is not None:
        ctrl.aggregator.reset_stats()
    else:
        ctrl._aggr_helper, ctrl._aggr_metrics_helper, ctrl._all_metrics = (
            WeightedAggregationHelper(), WeightedAggregationHelper(), True)
    seen = []
    for result in results:
        ctrl._aggregate_one_result(result)
        seen.append(sorted(os.listdir(ctrl.aggregator.directory)) if ctrl.aggregator is not None else None)
    return ctrl._get_aggregated_result(), seen


@pytest.mark.parametrize("offload", [False, True])
def test_budgeted_fedavg_aggregates_through_disk_only_with_disk_offload(tmp_path, offload):
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from nvfp4_jax.federated.server import META_KEY, BudgetedFedAvg

    ctrl = BudgetedFedAvg(run_config={}, site_names=["site-1", "site-2", "site-3"], num_rounds=1,
                          budget_policy={"name": "equal", "total_samples": 6, "quantum": 2},
                          output_dir=str(tmp_path), enable_tensor_disk_offload=offload, weighting="data")
    updates = _updates(3)
    updates[2]["bias"][0] = np.nan  # site-3's update is non-finite: left out
    results = [FLModel(params=u, params_type=ParamsType.DIFF,
                       meta={"client_name": f"site-{i + 1}",
                             META_KEY: {"samples": 2, "steps": 1, "seconds": 0.1, "data_tokens": tokens}})
               for i, (u, tokens) in enumerate(zip(updates, [100, 300, 50]))]
    aggregated, seen = _round(ctrl, results)
    assert ctrl._reports["site-3"]["failed"]
    expected = _helper_mean(updates[:2], [100.0, 300.0])  # weighted by the sites' data tokens
    assert all(np.array_equal(aggregated.params[k], expected[k]) for k in expected)
    if offload:
        assert seen[0] == seen[1] == ["0.sum", "1.sum", "2.sum", "3.sum"]
        assert ctrl.aggregator.last_round_bytes == sum(v.nbytes for v in updates[0].values())
        assert os.listdir(tmp_path / ".aggregation") == []  # removed with the round
    else:
        assert ctrl.aggregator is None and not (tmp_path / ".aggregation").exists()
