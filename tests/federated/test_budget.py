"""The budget controller, a pure function, against hand-computed splits."""

import pytest

from nvfp4_jax.federated.budget import (
    BudgetPolicy, SiteCost, allocate, check_policy, combined_costs, proportional_split, smooth,
)


def _costs(*taus):
    return [SiteCost(seconds_per_sample=t) for t in taus]


def test_equal_split_adds_up_with_largest_remainders_to_the_first_sites():
    # 64 samples, batch 8: 8 units; one unit each, 5 spare split 5/3 each -> [3, 3, 2] units.
    assert proportional_split(64, [1, 1, 1], 8, 8) == [24, 24, 16]
    p = BudgetPolicy(name="equal", total_samples=64, quantum=8)
    assert allocate(p, _costs(1, 2, 4), None, 3) == [24, 24, 16]


def test_time_only_split_is_inverse_to_the_per_sample_time():
    # tau = 1, 2, 4 s/sample; median 2 -> c = 0.5, 1, 2 -> weights 2, 1, 0.5.
    # 560 samples = 70 units of 8; one unit each; 67 spare: 38.29, 19.14, 9.57 -> 38, 19, 9, and
    # the one left over goes to the largest remainder (site 3): 39, 20, 11 units.
    p = BudgetPolicy(name="adaptive", total_samples=560, quantum=8)
    budgets = allocate(p, _costs(1.0, 2.0, 4.0), None, 1)
    assert budgets == [312, 160, 88]
    assert sum(budgets) == 560
    # Each site's busy time is about the same (312, 320, 352 s) where an equal split would make
    # the slowest site take 4 x 187 = 747 s.
    assert max(b * t for b, t in zip(budgets, (1, 2, 4))) == 352


def test_no_measurement_yet_means_an_equal_split():
    p = BudgetPolicy(name="adaptive", total_samples=48, quantum=8)
    assert allocate(p, [SiteCost(), SiteCost(1.0)], None, 0) == [24, 24]


def test_deadband_keeps_the_previous_split_for_small_moves_only():
    p = BudgetPolicy(name="adaptive", total_samples=800, quantum=8, deadband=0.05)
    previous = [400, 400]
    # 1.02 vs 1.0: proposal [400 +- 4 units...] moves ~1% -> kept.
    assert allocate(p, _costs(1.0, 1.02), previous, 2) == previous
    # 1.0 vs 1.5: proposal 480 / 320 moves 20% -> taken.
    assert allocate(p, _costs(1.0, 1.5), previous, 2) == [480, 320]


def test_static_profiles_once_then_keeps_its_split():
    p = BudgetPolicy(name="static", total_samples=800, quantum=8)
    r0 = allocate(p, [SiteCost(), SiteCost()], None, 0)
    assert r0 == [400, 400]
    r1 = allocate(p, _costs(1.0, 3.0), r0, 1)
    assert r1 == [600, 200]
    # Costs change later (site 2 got faster): static keeps its profile, adaptive follows.
    assert allocate(p, _costs(1.0, 1.0), r1, 2) == r1
    adaptive = BudgetPolicy(name="adaptive", total_samples=800, quantum=8)
    assert allocate(adaptive, _costs(1.0, 1.0), r1, 2) == [400, 400]


def test_a_very_slow_site_is_never_dropped():
    p = BudgetPolicy(name="adaptive", total_samples=80, quantum=8, min_samples=16)
    budgets = allocate(p, _costs(1.0, 1000.0), None, 1)
    assert budgets == [64, 16]


def test_ema_and_combined_cost():
    c = smooth(SiteCost(seconds_per_sample=2.0), seconds=40.0, samples=10, joules=None, ema=0.5)
    assert c.seconds_per_sample == pytest.approx(3.0)
    assert c.joules_per_sample is None
    c = smooth(c, seconds=10.0, samples=10, joules=50.0, ema=0.5)
    assert c.seconds_per_sample == pytest.approx(2.0) and c.joules_per_sample == pytest.approx(5.0)
    assert smooth(c, seconds=1.0, samples=0, joules=None, ema=0.5) == c  # nothing trained: unchanged
    # w_t = w_e = 0.5; tau 1, 2, 4 -> 0.5, 1, 2; eps 4, 2, 1 -> 2, 1, 0.5.
    costs = [SiteCost(1.0, 4.0), SiteCost(2.0, 2.0), SiteCost(4.0, 1.0)]
    assert combined_costs(costs, 0.5, 0.5) == pytest.approx([1.25, 1.0, 1.25])
    # Energy asked for but not measured on every site: the time term alone.
    partial = [SiteCost(1.0, None), SiteCost(2.0, 2.0)]
    assert combined_costs(partial, 1.0, 1.0) == pytest.approx([2 / 3, 4 / 3])


@pytest.mark.parametrize("change, message", [
    (dict(name="fastest"), "budget='fastest'"),
    (dict(total_samples=4), "cannot give each of 2 sites"),
    (dict(total_samples=18), "multiple of the global batch"),
    (dict(w_time=0.0, w_energy=0.0), "w_time + w_energy"),
    (dict(ema=0.0), "ema=0.0"),
    (dict(deadband=1.0), "deadband=1.0"),
])
def test_bad_policies_are_one_line_errors(change, message):
    p = BudgetPolicy(**{**dict(name="adaptive", total_samples=32, quantum=4), **change})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        check_policy(p, 2)


def test_silos_of_unequal_device_counts_get_budgets_in_their_own_global_batches():
    # Sites of 1, 2 and 4 devices, 2 rows a device: global batches 2, 4, 8.
    quanta = (2, 4, 8)
    p = BudgetPolicy(name="adaptive", total_samples=48, quantum=2, site_quanta=quanta)
    check_policy(p, 3)
    # Nothing measured: an equal split, each a multiple of its own batch: floors 2, 4, 8 and 34
    # spare, ideal 11.33 each -> 10, 8, 8; the 8 left go one quantum at a time to the largest
    # deficit that fits: site 2 (+4, deficit 3.33), then site 1 (+2, 1.33), then site 1 again (+2).
    assert allocate(p, _costs(None, None, None), None, 0) == [16, 16, 16]
    # A silo with 4 devices trains a sample in a quarter of the time: it gets about 4x the samples
    # of the 1-device silo (hand split: floors 2, 4, 8; tau 1, 0.5, 0.25 s/sample give weights
    # 1:2:4, so the spare 34 is 4.86, 9.71, 19.43 -> 4, 8, 16; of the 6 left site 3's 8 does not
    # fit, site 2 (deficit 1.71) takes 4, then site 1 (0.86) takes 2).
    budgets = allocate(p, _costs(1.0, 0.5, 0.25), [16, 16, 16], 1)
    assert budgets == [8, 16, 24] and sum(budgets) == 48
    assert all(b % q == 0 and b >= q for b, q in zip(budgets, quanta))
    # A split always fills the round exactly, whatever the weights.
    for taus in ((1.0, 1.0, 1.0), (9.0, 1.0, 1.0), (1.0, 9.0, 0.1), (0.3, 0.7, 5.0)):
        budgets = allocate(p, _costs(*taus), None, 1)
        assert sum(budgets) == 48 and all(b % q == 0 and b >= q for b, q in zip(budgets, quanta)), (taus, budgets)


@pytest.mark.parametrize("quanta, message", [
    ((4, 6), "global batches 4, 6 (rows a device x the site's devices) must all be multiples of the smallest (4)"),
    ((2, 4, 8), "3 site global batches for 2 sites"),
])
def test_silo_batches_that_cannot_fill_a_round_exactly_are_refused(quanta, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_policy(BudgetPolicy(total_samples=48, quantum=min(quanta), site_quanta=quanta), 2)
