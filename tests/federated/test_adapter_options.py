"""`--update adapters` with the privacy, compression and budget options: each acts on the adapter
update, and on it alone. The unit tests run a site's own round (`client._train_round`, the
function FLARE's client script calls) on a tiny model with LoRA adapters, then the site's result
filter (`privacy.make_filter`, FLARE's `process_dxo`) or the server's decoding and accounting, as
the job does; one end-to-end run in FLARE's simulator combines them."""

import dataclasses
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

pytest.importorskip("nvflare")
from nvfp4_jax.federated import accounting  # noqa: E402
from nvfp4_jax.federated import budget as budget_lib  # noqa: E402
from nvfp4_jax.federated import contract as C  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# test_adapters.py's 2-site job: one decoder layer, rank-4 adapters on an NVFP4 backbone.
KEYS = ["lora_rank=4", "quantization=te_nvfp4", "base_num_decoder_layers=1", "max_target_length=32",
        "per_device_batch_size=1", "eval_steps=1", "learning_rate=1e-2"]
RUN_CONFIG = {"model_name": "tiny", "run_name": "federated", "lora_rank": 4, "quantization": "te_nvfp4",
              "base_num_decoder_layers": 1, "max_target_length": 32, "per_device_batch_size": 1,
              "eval_steps": 1, "learning_rate": 1e-2, "steps": 8}
ADAPTERS = C.UpdateContract(kind="adapters")
ARGS = types.SimpleNamespace(data_path="", devices=1, device_offset=0, slowdown=1.0, watts=None, crash_in_round=0)


def _is_adapter(name: str) -> bool:
    return name.rsplit("/", 1)[-1] in ("lora_a", "lora_b")


@pytest.fixture(scope="module")
def site():
    """One site's trainer (built once: the compile is the module's cost) and the global model."""
    import jax

    from nvfp4_jax.config import make_config
    from nvfp4_jax.federated.site import SiteTrainer

    trainer = SiteTrainer(make_config(RUN_CONFIG), ADAPTERS, devices=jax.devices()[:1])
    initial = trainer.initial_params()
    assert trainer.trainable == [k for k in initial if _is_adapter(k)]
    return types.SimpleNamespace(trainer=trainer, initial=initial,
                                 sent={k: initial[k] for k in trainer.trainable})  # the server's downlink


def _round(site, compression="none", residual=None, samples=2, slowdown=1.0):
    """(payload, report, the site's residual after, the exact adapter update it trained): one
    round of `client._train_round` from the global model's adapters."""
    from nvfp4_jax.federated import client
    from nvfp4_jax.federated.site import flat_params

    spec = {"contract": dataclasses.asdict(dataclasses.replace(ADAPTERS, compression=compression)), "round": 1,
            "config": RUN_CONFIG, "budgets": {"site-1": samples}, "schedule_window": None}
    state = {"trainer": site.trainer, "residual": residual}
    site.trainer.slowdown = slowdown
    try:
        payload, report, _ = client._train_round(ARGS, "site-1", spec, types.SimpleNamespace(params=site.sent), state)
    finally:
        site.trainer.slowdown = 1.0
    trained = flat_params(site.trainer.state.params)
    # The frozen backbone stays as the site built it, bit for bit, whatever the option.
    for k, v in site.initial.items():
        if not _is_adapter(k):
            np.testing.assert_array_equal(trained[k], v, err_msg=k)
    update = {k: trained[k] - site.sent[k] for k in site.sent}
    return payload, report, state["residual"], update


def _norm(arrays) -> float:
    return float(np.sqrt(sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in arrays.values())))


def _filtered(name: str, options: dict, payload: dict) -> dict:
    """What leaves the site after its result filter: FLARE's DXO of the site's weight difference."""
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import Shareable

    from nvfp4_jax.federated.privacy import make_filter

    flt = make_filter(name, options)
    dxo = DXO(DataKind.WEIGHT_DIFF, {k: v.copy() for k, v in payload.items()})
    return flt.process_dxo(dxo, Shareable(), FLContext()).data


def test_gaussian_clips_the_adapter_update_to_its_own_norm_and_noises_only_the_adapters(site):
    from nvfp4_jax.federated.privacy import GaussianPrivacy

    payload, report, _, update = _round(site)
    assert sorted(payload) == sorted(site.sent)  # only the adapters leave the site
    assert report["payload_bytes"] == 4 * sum(v.size for v in site.sent.values())
    clip, nm, seed = 0.1, 0.5, 7
    norm = _norm(update)
    assert norm > 3 * clip  # the clip binds (the whole model's norm would be far larger)
    flt = GaussianPrivacy(clip_norm=clip, noise_multiplier=nm, insecure_seed=seed)
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import Shareable

    sent = flt.process_dxo(DXO(DataKind.WEIGHT_DIFF, dict(payload)), Shareable(), FLContext()).data
    assert sorted(sent) == sorted(site.sent)
    # The seed regenerates the noise, leaf by leaf in the payload's order: what is left is the
    # update scaled to the clip norm, the scale computed over the adapters alone.
    rng = np.random.default_rng(seed)
    noise = {k: rng.normal(0.0, nm * clip, size=v.shape).astype(np.float32) for k, v in payload.items()}
    for k in sent:
        np.testing.assert_allclose(sent[k] - noise[k], update[k] * (clip / norm), atol=1e-6, err_msg=k)
    # The noise per coordinate: std noise_multiplier * clip_norm (9,728 draws: relative standard
    # error 0.7%; 5% is 7 of them), mean 0.
    residue = np.concatenate([(sent[k] - update[k] * (clip / norm)).ravel() for k in sent])
    assert abs(residue.std() / (nm * clip) - 1) < 0.05
    assert abs(residue.mean()) < 5 * nm * clip / np.sqrt(residue.size)


def test_percentile_and_svt_select_among_the_adapter_values(site):
    payload, _, _, _ = _round(site)
    n = sum(v.size for v in payload.values())
    sent = _filtered("percentile", {"percentile": 90.0, "gamma": 1e-3}, payload)
    values = np.concatenate([sent[k].ravel() for k in payload])
    assert sorted(sent) == sorted(payload)
    assert np.count_nonzero(values) == pytest.approx(0.1 * n, abs=2)  # the top 10% of the adapters' values
    assert np.abs(values).max() == pytest.approx(1e-3)
    sent = _filtered("svt", {"fraction": 0.05, "epsilon": 1.0, "noise_var": 1.0, "gamma": 1e-3}, payload)
    assert sorted(sent) == sorted(payload)
    assert 0 < sum(np.count_nonzero(v) for v in sent.values()) <= np.ceil(0.05 * n)


def test_privacy_accounting_counts_the_adapters_a_site_could_send(site):
    """svt's epsilon grows with the values a site sends; one that sent nothing is charged the most
    it could have sent: under adapters the adapters' values, not the whole model's."""
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from nvfp4_jax.federated.server import BudgetedFedAvg

    svt = {"filter": "svt", "fraction": 0.1, "epsilon": 0.1, "noise_var": 0.1, "gamma": 1e-5}
    gauss = {"filter": "gaussian", "clip_norm": 1.0, "noise_multiplier": 2.0}
    ctrl = BudgetedFedAvg(run_config=RUN_CONFIG, site_names=["site-1", "site-2", "site-3"],
                          update_contract=dataclasses.asdict(ADAPTERS),
                          site_privacy={"site-1": svt, "site-2": svt, "site-3": gauss}, dp_delta=1e-5)
    n_adapters = sum(v.size for v in site.sent.values())
    n_model = sum(v.size for v in site.initial.values())
    assert n_model > 20 * n_adapters
    ctrl._values_sent = {"site-1": n_adapters, "site-3": n_adapters}  # site-2's update did not arrive
    model = FLModel(params=dict(site.initial), params_type=ParamsType.FULL)
    spent = ctrl._account(model)
    expected = accounting.svt_round_epsilon(svt, n_adapters)  # 0.1 + 973 x 0.1
    assert spent["site-1"]["epsilon"] == spent["site-2"]["epsilon"] == pytest.approx(expected)
    assert expected < accounting.svt_round_epsilon(svt, n_model) / 20
    assert spent["site-3"]["epsilon"] == pytest.approx(accounting.gaussian_epsilon(2.0, 1, 1e-5))
    spent = ctrl._account(model)  # a second round composes
    assert spent["site-2"]["epsilon"] == pytest.approx(2 * expected)
    assert spent["site-3"]["epsilon"] == pytest.approx(accounting.gaussian_epsilon(2.0, 2, 1e-5))


def _compressed_bytes(compression: str, arrays: dict) -> int:
    """fp8: a byte a value and an fp32 scale a tensor; nvfp4: half a byte a value (two E2M1 codes
    a byte), one E4M3 scale per 16 values and an fp32 tensor scale, each tensor padded to 16."""
    if compression == "fp8":
        return sum(v.size + 4 for v in arrays.values())
    blocks = [-(-v.size // 16) for v in arrays.values()]
    return sum(16 * b // 2 + b + 4 for b in blocks)


@pytest.mark.parametrize("compression, factor, error", [("fp8", 3.9, 0.0625), ("nvfp4", 7.0, 0.2)])
def test_compression_shrinks_the_adapter_payload_and_feeds_its_error_back(site, compression, factor, error):
    payload_1, report_1, residual_1, update_1 = _round(site, compression)
    float32 = 4 * sum(v.size for v in site.sent.values())
    assert report_1["payload_bytes"] == _compressed_bytes(compression, site.sent) < float32 / factor
    assert {k.rpartition("::")[0] for k in payload_1} == set(site.sent)  # the adapters' codes only
    assert sorted(report_1["shapes"]) == sorted(site.sent)
    decoded_1 = C.decode(payload_1, compression, report_1["shapes"])  # what the server averages
    for k, u in update_1.items():
        # The format's error: E4M3 rounds to 3 mantissa bits (relative 2^-4 at most); E2M1 in
        # blocks of 16 measured 0.12 here, 0.2 stated.
        assert 0 < np.linalg.norm(decoded_1[k] - u) <= error * np.linalg.norm(u), k
    # Error feedback: the residual is kept for the adapters alone, and the next round sends it on,
    # so the two rounds' decoded updates plus what is left add up to what the site trained.
    assert sorted(residual_1) == sorted(site.sent) and _norm(residual_1) > 1e-3
    payload_2, report_2, residual_2, update_2 = _round(site, compression, residual_1)
    decoded_2 = C.decode(payload_2, compression, report_2["shapes"])
    for k in site.sent:
        np.testing.assert_allclose(decoded_1[k] + decoded_2[k] + residual_2[k], update_1[k] + update_2[k],
                                   atol=2e-6, err_msg=k)
    without_feedback = C.encode(update_2, compression)[0]
    assert _norm({k: C.decode(without_feedback, compression, report_2["shapes"])[k] - decoded_2[k]
                  for k in site.sent}) > 0.5 * _norm(residual_1)


def test_the_adaptive_budget_splits_adapter_rounds_by_measured_speed(site):
    """Two sites' adapter rounds, the second 3x slower (`--slowdown`): the adaptive policy gives
    the fast one more of the round's samples; equal keeps the split even."""
    _, fast, _, _ = _round(site, samples=4)
    _, slow, _, _ = _round(site, samples=4, slowdown=3.0)
    assert slow["seconds"] > 1.5 * fast["seconds"]
    costs = [budget_lib.smooth(budget_lib.SiteCost(), r["seconds"], r["samples"], None, 0.5) for r in (fast, slow)]
    policy = budget_lib.BudgetPolicy(name="adaptive", total_samples=16, quantum=1, deadband=0.0)
    adaptive = budget_lib.allocate(policy, costs, [8, 8], 1)
    equal = budget_lib.allocate(dataclasses.replace(policy, name="equal"), costs, [8, 8], 1)
    assert equal == [8, 8] and sum(adaptive) == 16
    assert adaptive[0] >= 1.4 * adaptive[1]
    # In proportion to the sites' speeds, to a sample.
    share = (1 / fast["seconds"]) / (1 / fast["seconds"] + 1 / slow["seconds"])
    assert abs(adaptive[0] - 16 * share) <= 1


def test_privacy_with_compression_is_refused_for_adapters_in_one_line(tmp_path):
    """FLARE's result filters run after the client script has encoded its update: a filter would
    noise the codes. The job says so, for adapters as for diff."""
    from nvfp4_jax.config import ConfigError
    from nvfp4_jax.federated.__main__ import build_spec

    for argv in (["--privacy", "gaussian", "--noise-multiplier", "1"], ["--site-privacy", "site-1=svt"]):
        with pytest.raises(ConfigError) as err:
            build_spec(["--update", "adapters", "--compression", "nvfp4", *argv, *KEYS,
                        f"base_output_directory={tmp_path}"])
        assert "filters uncompressed differences" in str(err.value) and "\n" not in str(err.value)


NM, CLIP = 0.5, 0.05


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One 2-site, 2-round job in FLARE's simulator (35 s here): `--update adapters --privacy
    gaussian --budget adaptive --slowdown 1,3`; its rounds, global model and initial model."""
    out = tmp_path_factory.mktemp("adapter_options")
    proc = subprocess.run(
        [sys.executable, "-m", "nvfp4_jax.federated", "--sites", "2", "--rounds", "2", "--update", "adapters",
         "--privacy", "gaussian", "--noise-multiplier", str(NM), "--clip-norm", str(CLIP), "--budget", "adaptive",
         "--slowdown", "1,3", "--samples-per-round", "8", *KEYS, f"base_output_directory={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from nvfp4_jax.config import load_config
    from nvfp4_jax.federated.site import Evaluator

    with open(out / "federated" / "federated.json") as f:
        rounds = json.load(f)["rounds"]
    model = np.load(out / "federated" / "global_model.npz")
    initial = Evaluator(load_config(KEYS[:4]), num_batches=1).initial_params()
    return types.SimpleNamespace(rounds=rounds, model={k: model[k] for k in model.files}, initial=initial)


@pytest.mark.slow
def test_two_sites_send_only_adapters_on_adaptive_budgets_with_epsilon_and_keep_the_backbone(job):
    """Only the adapters' bytes count; the epsilon is the accountant's; round 2 gives the fast
    site more samples; the backbone stays the initial one bit for bit."""
    adapter_bytes = sum(v.nbytes for k, v in job.model.items() if _is_adapter(k))
    for r in job.rounds[1:]:
        assert r["bytes_sent"] == 2 * adapter_bytes and r["full_model_bytes"] > 20 * adapter_bytes
        for s in ("site-1", "site-2"):
            assert r["privacy"][s]["epsilon"] == pytest.approx(accounting.gaussian_epsilon(NM, r["round"], 1e-5))
    assert job.rounds[1]["budgets"] == {"site-1": 4, "site-2": 4}  # equal until both are measured
    assert job.rounds[2]["budgets"]["site-1"] > job.rounds[2]["budgets"]["site-2"]  # site-2 is 3x slower
    for name, value in job.model.items():
        if not _is_adapter(name):
            np.testing.assert_array_equal(value, job.initial[name], err_msg=name)


@pytest.mark.slow
def test_the_global_adapters_move_by_the_sites_noise(job):
    """The adapters moved by FedAvg's weighted mean of the sites' noised updates: each round's
    noise std is nm * clip * sqrt(sum of the squared weights); the clipped signal (norm <= clip
    over 9,728 values) is 2% of it per coordinate. 9,728 draws: 5% is 7 standard errors. Fails
    when the sites' result filters are configured but not applied (FLARE 2.9 applies a filter
    chain only to the tasks it names: a "*" chain moved the adapters by the raw updates)."""
    moved = np.concatenate([(v - job.initial[k]).ravel() for k, v in job.model.items() if _is_adapter(k)])
    variance = 0.0
    for r in job.rounds[1:]:
        w = np.array([r["sites"][s]["weight"] for s in ("site-1", "site-2")], np.float64)
        variance += (NM * CLIP) ** 2 * float(np.sum((w / w.sum()) ** 2))
    assert abs(moved.std() / np.sqrt(variance) - 1) < 0.05
