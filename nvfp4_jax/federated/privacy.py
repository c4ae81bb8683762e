"""Privacy filters on what leaves a site: FLARE's own result filters, chosen per job.

| `--privacy` | filter | what it protects | what it costs |
|---|---|---|---|
| `none` | - | nothing: the server sees each site's exact update | - |
| `percentile` | FLARE `PercentilePrivacy(percentile, gamma)` | shares only the largest `100 - percentile`% of update magnitudes, each clipped to `gamma`: less of each site's update is revealed (Shokri & Shmatikov 2015); no formal guarantee | small updates are dropped, so convergence slows; `gamma` too small stalls training |
| `svt` | FLARE `SVTPrivacy(fraction, epsilon, ...)` | the sparse vector technique: a noisy selection of a `fraction` of coordinates, released with Laplace noise; differential privacy per round for the stated `epsilon` | noise in every released coordinate; most coordinates not sent |
| `gaussian` | `GaussianPrivacy(clip_norm, noise_multiplier)` (ours, a FLARE `DXOFilter`) | the Gaussian mechanism on the whole update: L2 clip to `clip_norm`, plus N(0, (noise_multiplier * clip_norm)^2) per coordinate; bounds any one round's influence (DP-FedAvg style, per site; account for epsilon over rounds yourself) | the noise scales with the model size; needs many sites or small noise to converge |

All three act on weight differences, so they need `--update diff` or `subset`, and uncompressed
updates (`--compression none`: compressing after a filter would need a second filter stage).
"""

from __future__ import annotations

import numpy as np
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.dxo_filter import DXOFilter

PRIVACY = ("none", "percentile", "svt", "gaussian")


class GaussianPrivacy(DXOFilter):
    """Clip the update to an L2 norm of `clip_norm`, then add Gaussian noise of standard deviation
    `noise_multiplier * clip_norm` to every coordinate.

    The noise comes from fresh operating-system entropy, drawn on the site when the filter is
    built: nothing the server or another site knows can regenerate it (with a shared seed every
    site would add the same noise, which the server could subtract). `insecure_seed` makes the
    noise reproducible for debugging and is INSECURE: whoever knows the seed can remove the noise.
    """

    def __init__(self, clip_norm: float = 1.0, noise_multiplier: float = 1.0, insecure_seed: int | None = None):
        super().__init__(supported_data_kinds=[DataKind.WEIGHT_DIFF], data_kinds_to_filter=[DataKind.WEIGHT_DIFF])
        if not (clip_norm > 0 and np.isfinite(clip_norm)):
            raise ValueError(f"clip_norm={clip_norm} must be positive and finite")
        if not (noise_multiplier > 0 and np.isfinite(noise_multiplier)):
            raise ValueError(f"noise_multiplier={noise_multiplier} must be positive and finite "
                             "(without noise the Gaussian mechanism protects nothing)")
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        # The constructor's arguments are what FLARE writes into the job's config: a site's
        # filter gets None here, so it seeds itself from the OS.
        self.insecure_seed = insecure_seed
        self._rng = np.random.default_rng(insecure_seed)

    def process_dxo(self, dxo: DXO, shareable, fl_ctx):
        dxo.data = clip_and_noise(dxo.data, self.clip_norm, self.noise_multiplier, self._rng)
        return dxo


def clip_and_noise(update: dict, clip_norm: float, noise_multiplier: float, rng: np.random.Generator) -> dict:
    norm = float(np.sqrt(sum(float(np.sum(np.square(np.asarray(v, np.float64)))) for v in update.values())))
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    sigma = noise_multiplier * clip_norm
    out = {}
    for name, value in update.items():
        v = np.asarray(value, np.float32) * np.float32(factor)
        if sigma > 0:
            v = v + rng.normal(0.0, sigma, size=v.shape).astype(np.float32)
        out[name] = v
    return out


def make_filter(name: str, options: dict):
    """The FLARE filter for `--privacy name`, or None."""
    if name == "none":
        return None
    if name == "percentile":
        # optional dependency (NVFLARE)
        from nvflare.app_common.filters import PercentilePrivacy

        return PercentilePrivacy(percentile=options.get("percentile", 10), gamma=options.get("gamma", 0.01))
    if name == "svt":
        # optional dependency (NVFLARE)
        from nvflare.app_common.filters import SVTPrivacy

        return SVTPrivacy(fraction=options.get("fraction", 0.1), epsilon=options.get("epsilon", 0.1),
                          noise_var=options.get("noise_var", 0.1), gamma=options.get("gamma", 1e-5))
    if name == "gaussian":
        return GaussianPrivacy(clip_norm=options.get("clip_norm", 1.0),
                               noise_multiplier=options["noise_multiplier"])
    raise ValueError(f"privacy={name!r} is not one of {', '.join(PRIVACY)}")
