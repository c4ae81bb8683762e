"""The privacy accountant: what each site's filter has spent, round by round, per site.

It is a site's data that a filter protects, so the epsilon is per site. Every round a site is
asked counts against it, whether or not its update arrived (an upper bound: a result dropped by
`--min-responses` or a timeout has still left the site).

| filter | accountant | epsilon |
|---|---|---|
| `gaussian` | dp_accounting's `RdpAccountant`: a `GaussianDpEvent(noise_multiplier)` composed once a round | at `delta` (`--dp-delta`); neighbouring relation: add or remove one site's clipped update (sensitivity `clip_norm`, the DP-FedAvg convention) |
| `svt` | basic composition: the sum of the per-round epsilon FLARE's `SVTPrivacy` states (`epsilon + n_upload * noise_var`, `n_upload = ceil(fraction x values sent)`) | pure DP (delta 0); loose: the sum is the simplest valid bound |
| `percentile` | none | null: the filter has no formal guarantee |
| `none` | none | null: the server sees the exact update |

Pure functions: a round's record for a site is a function of its policy, the delta, its previous
record and the number of values it sent.
"""

from __future__ import annotations

import functools
import math

import dp_accounting

RDP = "dp_accounting RdpAccountant (Gaussian mechanism composed once a round)"
SVT_SUM = "basic composition (sum of FLARE SVTPrivacy's stated per-round epsilon; pure DP)"
NO_GUARANTEE = {
    "none": "no privacy filter: the server sees the site's exact update",
    "percentile": "percentile privacy has no formal differential-privacy guarantee",
}


@functools.lru_cache(maxsize=4096)
def gaussian_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """Epsilon at `delta` of the Gaussian mechanism with `noise_multiplier`, composed `rounds` times (RDP)."""
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), count=rounds)
    return float(accountant.get_epsilon(delta))


def svt_round_epsilon(options: dict, values_sent: int) -> float:
    """The epsilon FLARE's SVTPrivacy states for one call on an update of `values_sent` values:
    the selection's `epsilon` plus the release's `n_upload * noise_var` (its `epsilon_release`)."""
    n_upload = min(math.ceil(values_sent * options["fraction"]), values_sent)
    return float(options["epsilon"]) + n_upload * float(options["noise_var"]) if n_upload > 0 else 0.0


def account_round(policy: dict, delta: float, previous: dict | None, values_sent: int) -> dict:
    """This round's privacy record of one site: `policy` is `{"filter": name, **options}`,
    `previous` the site's record of the round before (None in round 1)."""
    name = policy["filter"]
    rounds = (previous or {}).get("rounds", 0) + 1
    if name == "gaussian":
        nm = float(policy["noise_multiplier"])
        return {"filter": name, "rounds": rounds, "epsilon_round": gaussian_epsilon(nm, 1, delta),
                "epsilon": gaussian_epsilon(nm, rounds, delta), "delta": delta, "accountant": RDP}
    if name == "svt":
        spent = svt_round_epsilon(policy, values_sent)
        return {"filter": name, "rounds": rounds, "epsilon_round": spent,
                "epsilon": (previous or {}).get("epsilon", 0.0) + spent, "delta": 0.0, "accountant": SVT_SUM}
    return {"filter": name, "rounds": rounds, "epsilon_round": None, "epsilon": None, "delta": None,
            "accountant": None, "reason": NO_GUARANTEE[name]}


def summary(records: dict) -> str:
    """The round line's privacy part: `eps=1.23@delta=1e-05` when every accounted site agrees,
    else each site's; empty when no site has an epsilon."""
    spent = {site: (r["epsilon"], r["delta"]) for site, r in records.items() if r.get("epsilon") is not None}
    if not spent:
        return ""
    if len(set(spent.values())) == 1:
        eps, delta = next(iter(spent.values()))
        return f"eps={eps:.3g}@delta={delta:g}"
    return "eps " + " ".join(f"{site}={eps:.3g}@delta={delta:g}" for site, (eps, delta) in spent.items())
