"""Each site's learning-rate schedule runs in global steps: under unequal budgets every site
crosses the same window of the schedule in a round, instead of a fast site running ahead."""

import jax
import numpy as np
import optax
import pytest

from nvfp4_jax.federated.site import schedule_positions


def test_positions_stride_evenly_through_the_round_window():
    assert schedule_positions((8, 12), 4) == [8, 9, 10, 11]  # the nominal budget: one step each
    assert schedule_positions((8, 12), 8) == [8, 8, 9, 9, 10, 10, 11, 11]  # twice the budget
    assert schedule_positions((8, 12), 2) == [8, 10]  # half the budget: strides of two
    assert schedule_positions((8, 12), 1) == [8]
    with pytest.raises(ValueError, match="end before start"):
        schedule_positions((12, 8), 2)


def test_the_server_gives_round_r_the_nominal_share_s_window():
    from nvfp4_jax.federated.server import BudgetedFedAvg

    # 2 sites, 16 samples a round in batches of 2: a nominal site takes 4 steps a round.
    ctrl = BudgetedFedAvg(run_config={}, site_names=["site-1", "site-2"], num_rounds=3,
                          budget_policy={"name": "equal", "total_samples": 16, "quantum": 2})
    assert [ctrl._schedule_window(r) for r in range(3)] == [[0, 4], [4, 8], [8, 12]]


def test_a_schedule_count_is_set_where_adam_s_own_count_is_kept():
    from nvfp4_jax.federated.site import _with_schedule_count

    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.linear_schedule(0.0, 1.0, 10)))
    state = opt.init({"w": jax.numpy.zeros(3)})
    kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
    nodes = jax.tree.leaves(_with_schedule_count(state, 7), is_leaf=lambda n: isinstance(n, kinds))
    counts = {type(n).__name__: int(n.count) for n in nodes if isinstance(n, kinds)}
    assert counts == {"ScaleByAdamState": 0, "ScaleByScheduleState": 7}


@pytest.mark.slow
def test_sites_with_unequal_budgets_end_the_round_at_the_same_schedule_step():
    from nvfp4_jax.config import make_config
    from nvfp4_jax.federated.contract import UpdateContract
    from nvfp4_jax.federated.site import SiteTrainer

    keys = {"model_name": "tiny", "base_num_decoder_layers": 1, "max_target_length": 16,
            "per_device_batch_size": 2, "steps": 8, "quantization": "bf16", "eval_steps": 1}
    fast, slow = (SiteTrainer(make_config(keys), UpdateContract(kind="diff"), devices=jax.devices()[:1])
                  for _ in range(2))
    params = fast.initial_params()

    def schedule_count(site):
        (node,) = [n for n in jax.tree.leaves(site.state.opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByScheduleState))
                   if isinstance(n, optax.ScaleByScheduleState)]
        return int(node.count)

    # Round 1 of 2, window [0, 4): the fast site takes 8 steps, the slow one 2.
    fast.train_round(params, 16, schedule_window=(0, 4))
    slow.train_round(params, 4, schedule_window=(0, 4))
    # The fast site read steps 0, 0, 1, 1, 2, 2, 3, 3 of the schedule, the slow one 0 and 2 (the
    # count after a step is one more than the step it read); counting local steps they would be
    # at 8 and 2.
    assert (schedule_count(fast), schedule_count(slow)) == (4, 3)
    assert int(fast.state.step) == 8 and int(slow.state.step) == 2
    # Round 2, window [4, 8): both start where the window does, whatever they took before.
    fast.train_round(params, 16, schedule_window=(4, 8))
    slow.train_round(params, 4, schedule_window=(4, 8))
    assert (schedule_count(fast), schedule_count(slow)) == (8, 7)
    # The learning rate each applied is the schedule's over the same window: the slow site's
    # parameters after its 2 steps differ from one that ran its schedule locally.
    local = SiteTrainer(make_config(keys), UpdateContract(kind="diff"), devices=jax.devices()[:1])
    local.train_round(params, 4)
    local.train_round(params, 4)
    assert schedule_count(local) == 4
    moved = slow.initial_params()
    assert any(not np.array_equal(moved[k], local.initial_params()[k]) for k in moved)
