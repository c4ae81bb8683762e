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
