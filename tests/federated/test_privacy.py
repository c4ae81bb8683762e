"""The Gaussian mechanism on a site's update: clipping bounds the norm, the noise has the stated
standard deviation, and no two sites (nor two rounds) add the same noise."""

import numpy as np
import pytest

pytest.importorskip("nvflare")
from nvfp4_jax.federated.privacy import GaussianPrivacy, clip_and_noise  # noqa: E402

UPDATE = {"a": np.full((64, 64), 0.5, np.float32), "b": np.full((4096,), -0.25, np.float32)}


def _noise(flt: GaussianPrivacy, update=UPDATE) -> np.ndarray:
    sent = clip_and_noise(update, flt.clip_norm, flt.noise_multiplier, flt._rng)
    clipped = clip_and_noise(update, flt.clip_norm, 0.0, None)
    return np.concatenate([(sent[k] - clipped[k]).ravel() for k in update])


def test_two_sites_and_two_rounds_draw_different_noise():
    site_1, site_2 = GaussianPrivacy(1.0, 0.5), GaussianPrivacy(1.0, 0.5)
    first = _noise(site_1)
    assert not np.allclose(first, _noise(site_2), atol=1e-3)  # two sites built alike
    assert not np.allclose(first, _noise(site_1), atol=1e-3)  # one site, the next round
    # A seed the server could know (the old default of 0) regenerates the noise: refused as default.
    regenerated = np.random.default_rng(0).normal(0.0, 0.5, first.shape)
    assert not np.allclose(first, regenerated, atol=1e-3)


def test_the_insecure_seed_reproduces_the_noise():
    assert np.array_equal(_noise(GaussianPrivacy(1.0, 0.5, insecure_seed=3)),
                          _noise(GaussianPrivacy(1.0, 0.5, insecure_seed=3)))


def test_noise_std_is_noise_multiplier_times_clip_norm():
    flt = GaussianPrivacy(clip_norm=2.0, noise_multiplier=0.3)
    noise = _noise(flt)  # 8192 draws: the sample std's relative standard error is 1/sqrt(2n) = 0.8%
    assert abs(noise.std() / 0.6 - 1) < 0.04  # 5 standard errors
    assert abs(noise.mean()) < 5 * 0.6 / np.sqrt(noise.size)


def test_clipping_bounds_the_norm_and_leaves_a_small_update_alone():
    norm = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in UPDATE.values()))
    clipped = clip_and_noise(UPDATE, 1.0, 0.0, None)
    clipped_norm = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in clipped.values()))
    assert norm > 1.0 and clipped_norm == pytest.approx(1.0, rel=1e-6)
    small = clip_and_noise(UPDATE, 2 * norm, 0.0, None)
    assert all(np.array_equal(small[k], UPDATE[k]) for k in UPDATE)


@pytest.mark.parametrize("noise_multiplier", [0.0, -1.0, float("nan")])
def test_no_noise_is_refused(noise_multiplier):
    with pytest.raises(ValueError, match="noise_multiplier"):
        GaussianPrivacy(1.0, noise_multiplier)


def _filtered(name: str, options: dict, update: dict) -> dict:
    """What a site sends after the filter `--privacy name` builds (FLARE's own process_dxo)."""
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import Shareable

    from nvfp4_jax.federated.privacy import make_filter

    dxo = DXO(DataKind.WEIGHT_DIFF, {k: v.copy() for k, v in update.items()})
    return make_filter(name, options).process_dxo(dxo, Shareable(), FLContext()).data


RANDOM = {"a": np.random.default_rng(1).normal(size=(40, 50)), "b": np.random.default_rng(2).normal(size=(1000,))}


def test_percentile_sends_only_the_largest_magnitudes_each_clipped_to_gamma():
    sent = _filtered("percentile", {"percentile": 90, "gamma": 0.5}, RANDOM)
    values, original = (np.concatenate([d[k].ravel() for k in RANDOM]) for d in (sent, RANDOM))
    kept = values != 0
    assert kept.sum() == pytest.approx(0.1 * values.size, abs=2)  # the top 10%
    cutoff = np.percentile(np.abs(original), 90)
    assert np.all(np.abs(original[kept]) >= cutoff) and np.all(np.abs(original[~kept]) <= cutoff)
    assert np.abs(values).max() == 0.5 and np.array_equal(values[kept], np.clip(original[kept], -0.5, 0.5))


@pytest.mark.parametrize("fraction", [0.05, 0.2])
def test_svt_releases_at_most_the_fraction_of_coordinates_clipped_and_noised(fraction):
    sent = _filtered("svt", {"fraction": fraction, "epsilon": 1.0, "noise_var": 1.0, "gamma": 0.3}, RANDOM)
    values = np.concatenate([sent[k].ravel() for k in RANDOM])
    assert 0 < np.count_nonzero(values) <= np.ceil(fraction * values.size)
    # Released values are clipped to gamma, then Laplace noise of scale 2 gamma / noise_var is added.
    assert np.abs(values).max() > 0.3


def test_every_filter_option_has_a_default_and_a_check():
    from nvfp4_jax.federated.privacy import resolve_options

    assert resolve_options("svt", {}) == {"fraction": 0.1, "epsilon": 0.1, "noise_var": 0.1, "gamma": 1e-5}
    assert resolve_options("percentile", {"gamma": 0.2}) == {"percentile": 10.0, "gamma": 0.2}
    with pytest.raises(ValueError, match="fraction=0.0 must be in"):
        resolve_options("svt", {"fraction": 0.0})
    with pytest.raises(ValueError, match="sigma is not an option of gaussian"):
        resolve_options("gaussian", {"sigma": 1.0})
