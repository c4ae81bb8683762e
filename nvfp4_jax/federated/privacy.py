"""Privacy filters on what leaves a site: FLARE's own result filters, chosen per job.

| `--privacy` | filter | what it protects | what it costs |
|---|---|---|---|
| `none` | - | nothing: the server sees each site's exact update | - |
| `percentile` | FLARE `PercentilePrivacy(percentile, gamma)` | shares only the largest `100 - percentile`% of update magnitudes, each clipped to `gamma`: less of each site's update is revealed (Shokri & Shmatikov 2015); no formal guarantee | small updates are dropped, so convergence slows; `gamma` too small stalls training |
| `svt` | FLARE `SVTPrivacy(fraction, epsilon, ...)` | the sparse vector technique: a noisy selection of a `fraction` of coordinates, released with Laplace noise; differential privacy per round for the stated `epsilon` | noise in every released coordinate; most coordinates not sent |
| `gaussian` | `GaussianPrivacy(clip_norm, noise_multiplier)` (ours, a FLARE `DXOFilter`) | the Gaussian mechanism on the whole update: L2 clip to `clip_norm`, plus N(0, (noise_multiplier * clip_norm)^2) per coordinate; bounds any one round's influence (DP-FedAvg style, per site; `accounting.py` reports epsilon over the rounds) | the noise scales with the model size; needs many sites or small noise to converge |

All three act on weight differences, so they need `--update diff`, `subset` or `adapters`, and uncompressed
updates (`--compression none`: compressing after a filter would need a second filter stage).
`OPTIONS` lists every filter's options with its default and allowed range; a site can have its
own filter (`--site-privacy`, `parse_site_privacy`).
"""

from __future__ import annotations

import math

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


def _positive(v: float) -> bool:
    return v > 0 and math.isfinite(v)


# Every filter's options: default, the check, what is allowed (FLARE's documented ranges).
OPTIONS = {
    "none": {},
    "percentile": {
        "percentile": (10.0, lambda v: 0 <= v < 100, "in [0, 100): the share kept is the top 100 - P%"),
        "gamma": (0.01, _positive, "positive and finite: each kept value is clipped to +-gamma"),
    },
    "svt": {
        "fraction": (0.1, lambda v: 0 < v <= 1, "in (0, 1]: the fraction of coordinates released"),
        "epsilon": (0.1, _positive, "positive and finite: the selection's privacy budget"),
        "noise_var": (0.1, _positive, "positive and finite: the release budget per released value"),
        "gamma": (1e-5, _positive, "positive and finite: each released value is clipped to +-gamma"),
    },
    "gaussian": {
        "clip_norm": (1.0, _positive, "positive and finite"),
        "noise_multiplier": (0.0, _positive, "positive and finite (without noise it protects nothing)"),
    },
}


def resolve_options(name: str, given: dict, spell=lambda key: key) -> dict:
    """`given` checked and completed with the filter's defaults; ValueError naming the option
    (as `spell(key)` writes it), its value and what is allowed."""
    if name not in OPTIONS:
        raise ValueError(f"privacy={name!r} is not one of {', '.join(PRIVACY)}")
    allowed = OPTIONS[name]
    for key in given:
        if key not in allowed:
            raise ValueError(f"{spell(key)} is not an option of {name} (its options: {', '.join(allowed) or 'none'})")
    options = {key: float(given.get(key, default)) for key, (default, _, _) in allowed.items()}
    for key, (_, check, what) in allowed.items():
        if not check(options[key]):
            raise ValueError(f"{spell(key)}={options[key]} must be {what}")
    return options


def parse_site_privacy(text: str, site_names: list) -> tuple[str, str, dict]:
    """`SITE=FILTER[:key=value,...]` -> (site, filter, options given); ValueError if malformed."""
    where = f"--site-privacy {text!r}"
    site, sep, rest = text.partition("=")
    if not sep:
        raise ValueError(f"{where} must be SITE=FILTER[:key=value,...]")
    if site not in site_names:
        raise ValueError(f"{where}: {site!r} is not a site of this job ({', '.join(site_names)})")
    name, _, pairs = rest.partition(":")
    if name not in PRIVACY:
        raise ValueError(f"{where}: {name!r} is not one of {', '.join(PRIVACY)}")
    given = {}
    for pair in filter(None, pairs.split(",")):
        key, sep, value = pair.partition("=")
        try:
            given[key] = float(value) if sep else None
        except ValueError:
            raise ValueError(f"{where}: {key}={value!r} is not a number") from None
        if given[key] is None:
            raise ValueError(f"{where}: {pair!r} must be key=value")
    return site, name, given


def make_filter(name: str, options: dict):
    """The FLARE filter for privacy `name` with `options` (checked, defaults filled), or None."""
    options = resolve_options(name, options)
    if name == "none":
        return None
    if name == "percentile":
        # optional dependency (NVFLARE)
        from nvflare.app_common.filters import PercentilePrivacy

        return PercentilePrivacy(**options)
    if name == "svt":
        # optional dependency (NVFLARE)
        from nvflare.app_common.filters import SVTPrivacy

        return SVTPrivacy(**options)
    return GaussianPrivacy(**options)
