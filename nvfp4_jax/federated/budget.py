"""Per-site sample budgets: equal, static (profiled once) and adaptive (re-split every round).

A round has a fixed total of training samples. Sites differ in how long (and how much energy) a
sample costs them; with an equal split the round waits for the slowest site while the others idle
at the barrier. The adaptive policy measures each site's per-sample time `tau_i` and energy
`eps_i`, smooths them with an exponential moving average, combines them into

    c_i = w_t * tau_i / median(tau) + w_e * eps_i / median(eps)

and gives each site samples in proportion to `1 / c_i`, so that every site finishes its share at
about the same time (w_e = 0: "time only"). A deadband keeps the previous split when no site's
share would move by more than the given fraction, so noise does not reshuffle budgets every
round. No site is ever dropped: each keeps at least `min_samples`.

Everything here is a pure function of its arguments (the controller in `server.py` holds the
state between rounds), so the policy is tested on its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

POLICIES = ("equal", "static", "adaptive")


@dataclasses.dataclass(frozen=True)
class BudgetPolicy:
    """How a round's samples are split between sites."""

    name: str = "adaptive"  # equal | static | adaptive
    total_samples: int = 0  # per round, over all sites
    quantum: int = 1  # every budget is a multiple of this (a site's global batch)
    # Sites of unequal device counts (hierarchical silos): each site's own global batch, its
    # budget a multiple of it; empty: every site's is `quantum`.
    site_quanta: tuple[int, ...] = ()
    min_samples: int = 0  # floor per site (rounded up to the quantum); 0 means one quantum
    w_time: float = 1.0
    w_energy: float = 0.0
    ema: float = 0.5  # weight of the newest measurement
    deadband: float = 0.05  # keep the previous split unless some share moves by more than this


def policy_from_dict(fields: Mapping) -> BudgetPolicy:
    """The policy `dataclasses.asdict` wrote (through a job's JSON config: its tuple a list)."""
    return BudgetPolicy(**{**fields, "site_quanta": tuple(fields.get("site_quanta", ()))})


@dataclasses.dataclass(frozen=True)
class SiteCost:
    """EMA-smoothed per-sample cost of one site; `None` until it has been measured."""

    seconds_per_sample: float | None = None
    joules_per_sample: float | None = None


def check_policy(p: BudgetPolicy, num_sites: int) -> None:
    """Raises ValueError (one line) for a policy that cannot split a round between the sites."""
    if p.name not in POLICIES:
        raise ValueError(f"budget={p.name!r} is not one of {', '.join(POLICIES)}")
    if num_sites < 1:
        raise ValueError(f"sites={num_sites} must be at least 1")
    if p.quantum < 1:
        raise ValueError(f"the budget quantum (a site's global batch) is {p.quantum}; it must be >= 1")
    if p.site_quanta:
        if len(p.site_quanta) != num_sites:
            raise ValueError(f"{len(p.site_quanta)} site global batches for {num_sites} sites")
        smallest = min(p.site_quanta)
        if smallest != p.quantum or any(q % smallest for q in p.site_quanta):
            # Then whatever the weights, the largest-remainder split can fill the round exactly.
            raise ValueError(f"the sites' global batches {', '.join(map(str, p.site_quanta))} (rows a device x "
                             f"the site's devices) must all be multiples of the smallest ({smallest}), so that "
                             f"every round splits exactly: give device counts that are multiples of the smallest")
    floors = site_floors(p, num_sites)
    if p.total_samples < sum(floors):
        each = "" if p.site_quanta else f" of {floors[0]} samples (the global batch is {p.quantum})"
        raise ValueError(
            f"samples_per_round={p.total_samples} cannot give each of {num_sites} sites its minimum{each}; "
            f"use at least {sum(floors)}")
    if p.total_samples % p.quantum:
        raise ValueError(f"samples_per_round={p.total_samples} must be a multiple of the global batch {p.quantum}")
    for name, w in (("w_time", p.w_time), ("w_energy", p.w_energy)):
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"{name}={w} must be finite and >= 0")
    if p.w_time + p.w_energy <= 0:
        raise ValueError("w_time + w_energy must be > 0")
    if not 0 < p.ema <= 1:
        raise ValueError(f"ema={p.ema} must be in (0, 1]")
    if not 0 <= p.deadband < 1:
        raise ValueError(f"deadband={p.deadband} must be in [0, 1)")


def site_quanta(p: BudgetPolicy, num_sites: int) -> list[int]:
    """Each site's budget quantum: its own global batch."""
    return list(p.site_quanta) if p.site_quanta else [p.quantum] * num_sites


def site_floors(p: BudgetPolicy, num_sites: int) -> list[int]:
    """Each site's least budget: `min_samples` rounded up to its quantum, at least one quantum."""
    return [max(q, -(-p.min_samples // q) * q) for q in site_quanta(p, num_sites)]


def smooth(previous: SiteCost, seconds: float, samples: int, joules: float | None, ema: float) -> SiteCost:
    """The site's cost after one more round of `samples` taking `seconds` (and `joules`)."""
    if samples <= 0:
        return previous

    def mix(old, new):
        if new is None:
            return old
        return new if old is None else ema * new + (1.0 - ema) * old

    return SiteCost(
        seconds_per_sample=mix(previous.seconds_per_sample, seconds / samples),
        joules_per_sample=mix(previous.joules_per_sample, None if joules is None else joules / samples),
    )


def combined_costs(costs: Sequence[SiteCost], w_time: float, w_energy: float) -> list[float]:
    """`c_i = w_t tau_i / median(tau) + w_e eps_i / median(eps)`; a term whose measurements are
    missing for some site is left out for all sites."""
    def normalised(values):
        if any(v is None for v in values):
            return None
        med = _median(values)
        return [v / med if med > 0 else 1.0 for v in values]

    tau = normalised([c.seconds_per_sample for c in costs])
    eps = normalised([c.joules_per_sample for c in costs])
    out = [0.0] * len(costs)
    used = False
    for weight, terms in ((w_time, tau), (w_energy, eps)):
        if terms is not None and weight > 0:
            used = True
            out = [o + weight * t for o, t in zip(out, terms)]
    return out if used else [1.0] * len(costs)


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def proportional_split(total: int, weights: Sequence[float], quantum: int | Sequence[int],
                       floor: int | Sequence[int]) -> list[int]:
    """`total` split in proportion to `weights`, site i's share a multiple of its quantum and at
    least its floor (one number: every site's), the shares adding up to `total` exactly when the
    quanta are multiples of the smallest and `total` is a multiple of it: largest remainder, one
    quantum at a time to the site furthest below its ideal share that still fits, then what is
    left (a multiple of the smallest quantum) to the sites of the smallest quantum."""
    n = len(weights)
    quanta = [quantum] * n if isinstance(quantum, int) else list(quantum)
    floors = [floor] * n if isinstance(floor, int) else list(floor)
    spare = total - sum(floors)
    wsum = sum(weights)
    ideal = [spare * w / wsum for w in weights]
    extra = [math.floor(x / q) * q for x, q in zip(ideal, quanta)]
    left = spare - sum(extra)
    while True:
        # Largest remainder first; ties go to the lower index, so the split is deterministic.
        fits = [i for i in range(n) if quanta[i] <= left]
        if not fits:
            break
        i = min(fits, key=lambda i: (-(ideal[i] - extra[i]), i))
        extra[i] += quanta[i]
        left -= quanta[i]
    return [f + e for f, e in zip(floors, extra)]


def allocate(p: BudgetPolicy, costs: Sequence[SiteCost], previous: Sequence[int] | None,
             round_index: int) -> list[int]:
    """The samples each site trains on in round `round_index` (0-based).

    equal: the same share every round. static: equal in round 0 (the profiling round), then the
    split from the costs measured in it, kept for good. adaptive: equal until every site has been
    measured, then re-split every round from the smoothed costs, unless within the deadband.
    """
    n = len(costs)
    quanta, floors = site_quanta(p, n), site_floors(p, n)
    equal = proportional_split(p.total_samples, [1.0] * n, quanta, floors)
    measured = all(c.seconds_per_sample is not None or c.joules_per_sample is not None for c in costs)
    if p.name == "equal" or not measured:
        return equal
    if p.name == "static" and round_index > 1 and previous is not None:
        return list(previous)
    inverse = [1.0 / c for c in combined_costs(costs, p.w_time, p.w_energy)]
    proposal = proportional_split(p.total_samples, inverse, quanta, floors)
    if p.name == "adaptive" and previous is not None and len(previous) == n:
        moved = max(abs(a - b) / max(b, 1) for a, b in zip(proposal, previous))
        if moved <= p.deadband:
            return list(previous)
    return proposal


SILO_POLICIES = ("off", "equal", "static", "adaptive")  # off: FSDP over a site's devices


@dataclasses.dataclass(frozen=True)
class SiloPolicy:
    """How a site with several devices splits its step batch between them (`silo.py`): FSDP
    (`off`), or `allocate` over microbatches of `microbatch` rows with the policy `name`."""

    name: str = "off"
    microbatch: int = 1  # rows a microbatch
    ema: float = 0.5
    deadband: float = 0.05

    @property
    def on(self) -> bool:
        return self.name != "off"


def check_silo(policy: SiloPolicy, devices: int, batch_rows: int) -> int:
    """The step's microbatches for a site of `devices` devices and `batch_rows` rows a step;
    ValueError (one line, naming the value and what is allowed) otherwise."""
    if policy.name not in SILO_POLICIES:
        raise ValueError(f"silo shares {policy.name!r} is not allowed: one of {', '.join(SILO_POLICIES)}")
    if policy.microbatch < 1 or batch_rows % policy.microbatch:
        raise ValueError(f"--silo-microbatch={policy.microbatch} must be >= 1 and divide the site's "
                         f"{batch_rows} rows a step (per_device_batch_size x its devices)")
    microbatches = batch_rows // policy.microbatch
    if microbatches < devices:
        raise ValueError(f"--silo-microbatch={policy.microbatch}: {microbatches} microbatches a step for "
                         f"{devices} devices; every device needs at least one")
    return microbatches


def by_site(names: Sequence[str], budgets: Sequence[int]) -> Mapping[str, int]:
    return dict(zip(names, (int(b) for b in budgets)))
