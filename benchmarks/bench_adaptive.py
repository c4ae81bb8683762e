"""Adaptive sample budgets against equal and static splits, measured end to end.

Regimes:
  ddp  `python -m nvfp4_jax.federated.ddp`: 3 worker processes, a fixed global batch of 16
       microbatches a step, re-split every 2 steps; makespan = the training's wall time (the sum
       of each period's slowest worker wall time, from shares.json), idle = the workers' time
       waiting at the step barriers.
  pma  `python -m nvfp4_jax.federated` in FLARE's simulator (periodic model averaging, FedAvg
       rounds): 3 sites, 240 samples a round; makespan = the rounds' measured wall times.
  hfl  the same job over silos of unequal device counts with per-device shares inside a silo
       (`--site-devices 2,1 --silo-shares P`): site-1's 2 devices train each step's 8 rows in
       microbatches of 2 rows, site-2 trains 4 rows a step on 1 device; the policy P splits both
       the round between the sites and every step between site-1's devices; 256 samples a round.
Beside the end-to-end makespan, pma and hfl report the makespan after the profiling round
(`steady_makespan_s`, rounds 2..R): round 1 is an equal split under every policy and carries
the sites' start-up compilation.
Scenarios (emulated speeds: compute stretched by sleeping, as the sites and workers do):
  steady   slowdowns 1x / 2x / 4x for the whole run (the paper's spread);
  midrun   ddp only: all 1x, then worker 3 becomes 4x slower halfway (only a policy that keeps
           measuring can follow: static profiled the first period).
  hfl      site-1's devices 1x and 4x, site-2's device 2x (the paper's spread over the three).
Beside each: the best any integer split could do for the given speeds (`best_reduction`), a bound
that ignores the per-step overheads a real step has.

    .venv/bin/python benchmarks/bench_adaptive.py [--seeds 3] [--quick] [--regimes ddp,pma,hfl] [--out PATH]

--quick: one seed, the ddp runs and the steady pma and hfl runs with 2 rounds of half the samples (about 9
minutes here, by the full runs' per-run times). Prints one
line per run (`regime=... policy=... seed=... makespan_s=...`); writes
benchmarks/results/adaptive.json (+ adaptive.png with matplotlib).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import environment, save_plot, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("equal", "static", "adaptive")
DDP_MODEL = ["model_name=tiny", "base_num_decoder_layers=2", "max_target_length=128", "per_device_batch_size=16",
             "ici_fsdp_parallelism=1", "quantization=bf16"]
DDP_STEPS, DDP_PERIOD, DDP_MICROBATCHES = 16, 2, 16
PMA_MODEL = ["base_num_decoder_layers=2", "max_target_length=64", "per_device_batch_size=2", "eval_steps=2"]
# enough compute a round to stand above FLARE's dispatch and polling (48 until 14abd5f)
PMA_SAMPLES, PMA_QUANTUM = 240, 2
SCENARIOS = {"steady": ([1.0, 2.0, 4.0], 0), "midrun": ([1.0, 1.0, 4.0], DDP_STEPS // 2)}
# a round's samples; rows a device a step (per_device_batch_size); rows a microbatch in the silo
HFL_SAMPLES, HFL_ROWS, HFL_MICROBATCH = 256, 4, 2
HFL_DEVICE_SLOWDOWN, HFL_SITE_SLOWDOWN = (1.0, 4.0), 2.0  # site-1's two devices; site-2's one
REGIMES = ("ddp", "pma", "hfl")


def best_split(units: int, factors: list[float]) -> tuple[list[int], float]:
    """The split of `units` (each worker at least one) with the smallest slowest-worker time
    `max_i k_i f_i`, by enumeration, and that time."""
    best = None
    for cut in itertools.combinations(range(1, units), len(factors) - 1):
        split = [b - a for a, b in zip((0, *cut), (*cut, units))]
        t = max(k * f for k, f in zip(split, factors))
        if best is None or t < best[1]:
            best = (split, t)
    return best


def best_reduction(units: int, factors: list[float], slow_from: int = 0, steps: int = 1) -> float:
    """1 - (the best split's time) / (the equal split's), over `steps` steps of which the first
    `slow_from` run at full speed everywhere (where equal is best)."""
    equal = [units // len(factors) + (i < units % len(factors)) for i in range(len(factors))]
    fast = max(equal)
    slow_equal = max(k * f for k, f in zip(equal, factors))
    slow_best = best_split(units, factors)[1]
    return 1 - (slow_from * fast + (steps - slow_from) * slow_best) / (slow_from * fast + (steps - slow_from) * slow_equal)


def best_hfl_reduction(samples: int, rows: int, microbatch: int, device_factors: tuple[float, ...],
                       site_factor: float) -> float:
    """1 - (the best time) / (the equal split's) of a round of `samples` between a silo of
    len(device_factors) devices (each step `rows` rows a device, in microbatches of `microbatch`
    rows, the step as slow as its slowest device) and one device `site_factor` slower, in a row's
    time on the fastest device, without per-step overheads."""
    k = len(device_factors)
    silo_batch = rows * k

    def round_time(silo_samples, step):
        return max(silo_samples // silo_batch * step, (samples - silo_samples) * site_factor)

    equal_step = max(rows * f for f in device_factors)
    equal = round_time(samples // 2, equal_step)
    best_step = best_split(silo_batch // microbatch, list(device_factors))[1] * microbatch
    best = min(round_time(x, best_step) for x in range(silo_batch, samples - rows + 1, silo_batch))
    return 1 - best / equal


def _subprocess(cmd: list[str], env: dict | None = None) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **(env or {})})
    if proc.returncode:
        raise RuntimeError(proc.stdout[-1000:] + proc.stderr[-2000:])
    return proc.stdout


def run_ddp(policy: str, seed: int, scenario: str) -> dict:
    factors, slow_from = SCENARIOS[scenario]
    with tempfile.TemporaryDirectory() as out:
        _subprocess([sys.executable, "-m", "nvfp4_jax.federated.ddp", "--processes", "3", "--steps", str(DDP_STEPS),
                     "--period", str(DDP_PERIOD), "--policy", policy, "--slowdown", ",".join(map(str, factors)),
                     "--slowdown-from", str(slow_from), *DDP_MODEL, f"seed={seed}", f"base_output_directory={out}",
                     "run_name=ddp"])
        with open(os.path.join(out, "ddp", "shares.json")) as f:
            log = json.load(f)
    periods = log["periods"]
    return {"makespan_s": log["makespan_s"], "idle_s": sum(statistics.mean(p["idle_s"]) for p in periods),
            "final_loss": log["losses"][-1], "splits": [p["trained_with"] for p in periods]}


def _round_totals(trained: list[dict]) -> dict:
    """A federated run's totals over its trained rounds (federated.json's records)."""
    return {"makespan_s": sum(r["makespan_s"] for r in trained),
            "steady_makespan_s": sum(r["makespan_s"] for r in trained[1:]),
            "compute_makespan_s": sum(r["compute_makespan_s"] for r in trained),
            "idle_s": sum(statistics.mean(r["idle_s"].values()) for r in trained),
            "final_loss": trained[-1]["validation_loss"], "splits": [list(r["budgets"].values()) for r in trained]}


def run_pma(policy: str, seed: int, rounds: int, samples: int = PMA_SAMPLES) -> dict:
    with tempfile.TemporaryDirectory() as out:
        _subprocess([sys.executable, "-m", "nvfp4_jax.federated", "--sites", "3", "--rounds", str(rounds),
                     "--slowdown", "1,2,4", "--samples-per-round", str(samples), "--budget", policy,
                     *PMA_MODEL, f"seed={seed}", f"base_output_directory={out}"])
        with open(os.path.join(out, "federated", "federated.json")) as f:
            trained = json.load(f)["rounds"][1:]
    # FLARE's simulator adds seconds of dispatch and polling a round: beside the wall time, the
    # slowest site's busy time (compute makespan), where the split's effect is not diluted.
    return _round_totals(trained)


def run_hfl(policy: str, seed: int, rounds: int, samples: int = HFL_SAMPLES) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
        _subprocess([sys.executable, "-m", "nvfp4_jax.federated", "--sites", "2", "--site-devices", "2,1",
                     "--rounds", str(rounds), "--budget", policy, "--silo-shares", policy,
                     "--silo-microbatch", str(HFL_MICROBATCH),
                     "--slowdown", f"1,{HFL_SITE_SLOWDOWN}",
                     "--device-slowdown", "site-1=" + ",".join(map(str, HFL_DEVICE_SLOWDOWN)),
                     "--samples-per-round", str(samples), *PMA_MODEL, f"per_device_batch_size={HFL_ROWS}",
                     f"seed={seed}", f"base_output_directory={out}"], env)
        with open(os.path.join(out, "federated", "federated.json")) as f:
            trained = json.load(f)["rounds"][1:]
    silo = [r["sites"]["site-1"]["silo"] for r in trained]
    return {**_round_totals(trained), "silo_idle_s": sum(statistics.mean(s["idle_s"]) for s in silo),
            "device_splits": [s["trained_with"] for s in silo]}


def _summary(runs: list[dict]) -> dict:
    spans = [r["makespan_s"] for r in runs]
    out = {"makespan_median_s": statistics.median(spans), "makespan_min_s": min(spans), "makespan_max_s": max(spans),
           "final_loss_median": statistics.median(r["final_loss"] for r in runs), "runs": runs}
    for key in ("compute_makespan_s", "steady_makespan_s"):
        if key in runs[0]:
            out[key[:-2] + "_median_s"] = statistics.median(r[key] for r in runs)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pma-rounds", type=int, default=4)
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "adaptive.json"))
    a = p.parse_args()
    seeds = 1 if a.quick else a.seeds
    rounds = 2 if a.quick else a.pma_rounds
    shrink = 2 if a.quick else 1  # --quick: half the rounds' samples too
    pma_samples, hfl_samples = PMA_SAMPLES // shrink, HFL_SAMPLES // shrink
    regimes = a.regimes.split(",")
    if not regimes or any(r not in REGIMES for r in regimes):
        p.error(f"--regimes={a.regimes!r}: a comma-separated list of {', '.join(REGIMES)}")
    cases = [c for c in [("ddp", s) for s in SCENARIOS] + [("pma", "steady"), ("hfl", "hfl")] if c[0] in regimes]
    results = {}
    for regime, scenario in cases:
        block = {}
        for policy in POLICIES:
            runs = []
            for seed in range(seeds):
                run = {"ddp": lambda: run_ddp(policy, seed, scenario), "pma": lambda: run_pma(policy, seed, rounds, pma_samples),
                       "hfl": lambda: run_hfl(policy, seed, rounds, hfl_samples)}[regime]
                r = run()
                runs.append(r)
                compute = "".join(f" {k}={r[k]:.3f}" for k in ("steady_makespan_s", "compute_makespan_s") if k in r)
                print(f"regime={regime} scenario={scenario} policy={policy} seed={seed} makespan_s={r['makespan_s']:.3f}"
                      f"{compute} idle_s={r['idle_s']:.3f} final_loss={r['final_loss']:.4f}", flush=True)
            block[policy] = _summary(runs)
        base = block["equal"]["makespan_median_s"]
        for policy in ("static", "adaptive"):
            v = block[policy]
            v["reduction_vs_equal"] = 1 - v["makespan_median_s"] / base
            # The spread over seeds: the reduction of the seed-wise best and worst against equal's median.
            v["reduction_range"] = [1 - v["makespan_max_s"] / base, 1 - v["makespan_min_s"] / base]
            for kind in ("compute", "steady"):
                if f"{kind}_makespan_median_s" in v:
                    v[f"{kind}_reduction_vs_equal"] = 1 - v[f"{kind}_makespan_median_s"] / block["equal"][f"{kind}_makespan_median_s"]
        factors, slow_from = SCENARIOS.get(scenario, (None, 0))
        if regime == "ddp":
            block["best_reduction"] = best_reduction(DDP_MICROBATCHES, factors, slow_from, DDP_STEPS)
        elif regime == "hfl":
            block["best_reduction"] = best_hfl_reduction(hfl_samples, HFL_ROWS, HFL_MICROBATCH, HFL_DEVICE_SLOWDOWN, HFL_SITE_SLOWDOWN)
        else:
            block["best_reduction"] = best_reduction(pma_samples // PMA_QUANTUM, factors)
        results[f"{regime}/{scenario}"] = block
        print(f"regime={regime} scenario={scenario} reduction_vs_equal: static "
              f"{block['static']['reduction_vs_equal']:+.0%}, adaptive {block['adaptive']['reduction_vs_equal']:+.0%} "
              f"(best split possible {block['best_reduction']:.0%})", flush=True)
    write_json(Path(a.out), {
        "environment": environment(), "seeds": seeds, "quick": a.quick,
        "ddp": {"model": DDP_MODEL, "steps": DDP_STEPS, "period": DDP_PERIOD, "microbatches": DDP_MICROBATCHES,
                "processes": 3},
        "regimes": regimes,
        "pma": {"model": PMA_MODEL, "rounds": rounds, "samples_per_round": pma_samples, "sites": 3},
        "hfl": {"model": PMA_MODEL + [f"per_device_batch_size={HFL_ROWS}"], "rounds": rounds,
                "samples_per_round": hfl_samples, "site_devices": [2, 1], "silo_microbatch": HFL_MICROBATCH,
                "device_slowdown": {"site-1": list(HFL_DEVICE_SLOWDOWN), "site-2": [HFL_SITE_SLOWDOWN]}},
        "scenarios": {k: {"slowdown": f, "slowdown_from_step": s} for k, (f, s) in SCENARIOS.items()},
        "note": ("makespan: measured wall time of the training (ddp: sum of each period's slowest worker wall "
                 "time; pma, hfl: sum of the rounds' wall times; hfl's silo_idle_s: site-1's devices' mean idle time at its step barriers); the first period/round of every policy is an equal "
                 "split (nothing measured yet). best_reduction: the best integer split for the emulated speeds, "
                 "without per-step overheads. Speeds are emulated by sleeping on a 2-core CPU machine; the "
                 "paper's 71-80% are measured on real heterogeneous hardware."),
        "results": results})
    names = list(results)

    def draw(ax):
        for i, policy in enumerate(POLICIES):
            med = [results[n][policy]["makespan_median_s"] for n in names]
            lo = [m - results[n][policy]["makespan_min_s"] for n, m in zip(names, med)]
            hi = [results[n][policy]["makespan_max_s"] - m for n, m in zip(names, med)]
            ax.bar([j + 0.27 * (i - 1) for j in range(len(names))], med, 0.27, yerr=[lo, hi], label=policy, capsize=3)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("makespan (s), median and range over seeds")

    save_plot(Path(a.out), draw, figsize=(7, 4))

if __name__ == "__main__":
    main()
