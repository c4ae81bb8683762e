"""The privacy accountant: its epsilon is dp_accounting's for the same mechanism, grows with the
rounds, shrinks with the noise; SVT's is the sum of what FLARE's filter states; percentile has none."""

import numpy as np
import pytest

dp_accounting = pytest.importorskip("dp_accounting")
pytest.importorskip("nvflare")
from nvfp4_jax.federated import accounting  # noqa: E402

DELTA = 1e-5


def _rdp_one_event_per_round(noise_multiplier: float, rounds: int, delta: float) -> float:
    """Independently: one compose() call per round, as a round-by-round accountant would."""
    acc = dp_accounting.rdp.RdpAccountant()
    for _ in range(rounds):
        acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
    return acc.get_epsilon(delta)


def _pld(noise_multiplier: float, rounds: int, delta: float) -> float:
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier), rounds)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("noise_multiplier, rounds", [(0.8, 1), (1.0, 10), (2.0, 50)])
def test_gaussian_epsilon_is_dp_accountings(noise_multiplier, rounds):
    eps = accounting.gaussian_epsilon(noise_multiplier, rounds, DELTA)
    assert eps == pytest.approx(_rdp_one_event_per_round(noise_multiplier, rounds, DELTA), rel=1e-9)
    # The PLD accountant is tighter than RDP: RDP's epsilon is above it, by less than 10% here.
    pld = _pld(noise_multiplier, rounds, DELTA)
    assert pld <= eps <= 1.10 * pld


def test_one_round_is_at_least_the_exact_gaussian_mechanism():
    exact = dp_accounting.get_epsilon_gaussian(1.0, DELTA)  # the analytic Gaussian mechanism
    assert exact <= accounting.gaussian_epsilon(1.0, 1, DELTA) <= 1.10 * exact


def test_epsilon_grows_with_the_rounds_and_shrinks_with_the_noise():
    by_round = [accounting.gaussian_epsilon(1.0, r, DELTA) for r in range(1, 11)]
    assert all(a < b for a, b in zip(by_round, by_round[1:]))
    by_noise = [accounting.gaussian_epsilon(nm, 5, DELTA) for nm in (0.5, 1.0, 2.0, 4.0)]
    assert all(a > b for a, b in zip(by_noise, by_noise[1:]))
    # A larger delta buys a smaller epsilon.
    assert accounting.gaussian_epsilon(1.0, 5, 1e-3) < accounting.gaussian_epsilon(1.0, 5, 1e-7)


def test_a_site_is_charged_round_by_round():
    policy = {"filter": "gaussian", "clip_norm": 0.5, "noise_multiplier": 1.5}
    first = accounting.account_round(policy, DELTA, None, 100)
    second = accounting.account_round(policy, DELTA, first, 100)
    assert first["epsilon"] == first["epsilon_round"] == pytest.approx(_rdp_one_event_per_round(1.5, 1, DELTA))
    assert second["epsilon"] == pytest.approx(_rdp_one_event_per_round(1.5, 2, DELTA))
    assert second["epsilon_round"] == first["epsilon_round"] and second["rounds"] == 2
    assert second["delta"] == DELTA and "RdpAccountant" in second["accountant"]


def test_svt_is_the_sum_of_the_epsilon_flares_filter_states():
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import Shareable
    from nvflare.app_common.filters import SVTPrivacy

    options = {"fraction": 0.1, "epsilon": 0.5, "noise_var": 0.2, "gamma": 1.0}
    update = {"a": np.random.default_rng(0).normal(size=(40, 50)), "b": np.ones(1000)}
    flare = SVTPrivacy(**options)
    flare.process_dxo(DXO(DataKind.WEIGHT_DIFF, dict(update)), Shareable(), FLContext())
    policy = {"filter": "svt", **options}
    first = accounting.account_round(policy, DELTA, None, 3000)
    assert first["epsilon_round"] == pytest.approx(flare.get_privacy_spent())  # 0.5 + 300 x 0.2
    second = accounting.account_round(policy, DELTA, first, 3000)
    assert second["epsilon"] == pytest.approx(2 * flare.get_privacy_spent())
    assert second["delta"] == 0.0 and "sum" in second["accountant"]


@pytest.mark.parametrize("name", ["percentile", "none"])
def test_no_guarantee_is_null_with_the_reason(name):
    record = accounting.account_round({"filter": name}, DELTA, None, 10)
    assert record["epsilon"] is None and record["epsilon_round"] is None and record["reason"]


def test_the_round_line_shows_the_cumulative_epsilon():
    gaussian = accounting.account_round({"filter": "gaussian", "noise_multiplier": 1.0}, DELTA, None, 10)
    percentile = accounting.account_round({"filter": "percentile"}, DELTA, None, 10)
    same = accounting.summary({"site-1": gaussian, "site-2": gaussian, "site-3": percentile})
    assert same == f"eps={gaussian['epsilon']:.3g}@delta=1e-05"
    other = accounting.account_round({"filter": "gaussian", "noise_multiplier": 2.0}, DELTA, None, 10)
    assert accounting.summary({"site-1": gaussian, "site-2": other}).startswith("eps site-1=")
    assert accounting.summary({"site-1": percentile}) == ""


def test_the_server_prints_and_records_each_sites_epsilon(tmp_path, capsys):
    import json

    from nvflare.app_common.abstract.fl_model import FLModel

    from nvfp4_jax.federated.server import BudgetedFedAvg

    sites = {"site-1": {"filter": "gaussian", "clip_norm": 1.0, "noise_multiplier": 1.5},
             "site-2": {"filter": "gaussian", "clip_norm": 1.0, "noise_multiplier": 1.5},
             "site-3": {"filter": "percentile", "percentile": 10.0, "gamma": 0.01}}
    ctrl = BudgetedFedAvg(run_config={}, site_names=list(sites), num_rounds=2, output_dir=str(tmp_path),
                          budget_policy={"name": "equal", "total_samples": 6, "quantum": 2},
                          site_privacy=sites, dp_delta=1e-6)
    model = FLModel(params={"w": np.zeros(8, np.float32)})
    for r in (1, 2):
        ctrl._emit({"round": r, "validation_loss": 1.0, "budgets": {s: 2 for s in sites},
                    "sites": {s: {} for s in sites}, "makespan_s": 0.1, "bytes_sent": 0,
                    "privacy": ctrl._account(model)})
    eps = [accounting.gaussian_epsilon(1.5, r, 1e-6) for r in (1, 2)]
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"| eps={eps[1]:.3g}@delta=1e-06")
    result = json.loads((tmp_path / "federated.json").read_text())
    assert result["privacy"] == {"delta": 1e-6, "sites": sites}
    first, second = (r["privacy"] for r in result["rounds"])
    assert [first["site-1"]["epsilon"], second["site-1"]["epsilon"]] == pytest.approx(eps)
    assert second["site-1"]["epsilon_round"] == pytest.approx(eps[0])
    assert second["site-1"]["delta"] == 1e-6 and "RdpAccountant" in second["site-1"]["accountant"]
    assert second["site-3"]["epsilon"] is None and "no formal" in second["site-3"]["reason"]
