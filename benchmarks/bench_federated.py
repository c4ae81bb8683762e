"""Federated training in FLARE's simulator: equal vs static vs adaptive sample budgets, and the
bytes each update contract sends.

For each policy and seed it runs `python -m nvfp4_jax.federated` (3 sites whose compute is slowed
by 1x, 2x and 4x, the tiny model) and reads `federated.json`: per-round makespan (the round's
measured wall time, from the broadcast to the aggregated model) beside the slowest site's busy
time, each site's idle time at the round barrier, the coefficient of variation of the sites'
compute times, and the global validation loss against cumulative makespan. Then the
bytes one site sends under each update contract (full / diff / fp8 / nvfp4 / subset=mlp).

    .venv/bin/python benchmarks/bench_federated.py [--rounds 4] [--seeds 1] [--out PATH]

Writes benchmarks/results/federated.json (+ federated.png with the plot extra).
"""

from __future__ import annotations

import argparse
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
MODEL = ["base_num_decoder_layers=2", "max_target_length=64", "per_device_batch_size=2", "eval_steps=2"]


def _run(args: list[str], seed: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "nvfp4_jax.federated", *args, *MODEL, f"seed={seed}",
               f"base_output_directory={out}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        with open(os.path.join(out, "federated", "federated.json")) as f:
            return json.load(f)


def _summary(rounds: list[dict]) -> dict:
    trained = rounds[1:]
    makespans = [r["makespan_s"] for r in trained]
    compute = [r.get("compute_makespan_s", r["makespan_s"]) for r in trained]  # older records: busy time only
    idle = [statistics.mean(r["idle_s"].values()) for r in trained]
    clock, curve = 0.0, [(0.0, rounds[0]["validation_loss"])]
    for r in trained:
        clock += r["makespan_s"]
        curve.append((clock, r["validation_loss"]))
    # Round 1 of every policy is an equal split (nothing measured yet): report rounds 2.. too.
    later = makespans[1:] or makespans
    return {
        "makespan_total_s": sum(makespans), "makespan_median_s": statistics.median(makespans),
        "makespan_median_after_round1_s": statistics.median(later),
        "compute_makespan_median_after_round1_s": statistics.median(compute[1:] or compute),
        "idle_mean_s": statistics.mean(idle), "compute_cv_mean": statistics.mean(r["compute_cv"] for r in trained),
        "final_validation_loss": rounds[-1]["validation_loss"], "loss_vs_makespan": curve,
        "budgets": [r["budgets"] for r in trained],
    }


def _contract_bytes() -> dict:
    """Payload bytes of one site's update of the benchmark's model under each contract, measured on
    the arrays `contract.encode` produces (what the client sends, before FLARE's framing)."""
    import numpy as np

    from nvfp4_jax.config import make_config
    from nvfp4_jax.federated import contract as C
    from nvfp4_jax.federated.site import Evaluator

    cfg = make_config({"model_name": "tiny", **dict(m.split("=") for m in MODEL)})
    params = Evaluator(cfg, num_batches=1).initial_params()
    rng = np.random.default_rng(0)
    update = {k: (rng.standard_normal(v.shape) * 1e-3).astype(np.float32) for k, v in params.items()}
    values = sum(v.size for v in params.values())
    out = {}
    for name, contract in {
        "full": C.UpdateContract(kind="full"), "diff": C.UpdateContract(kind="diff"),
        "diff+fp8": C.UpdateContract(kind="diff", compression="fp8"),
        "diff+nvfp4": C.UpdateContract(kind="diff", compression="nvfp4"),
        "subset=mlp": C.UpdateContract(kind="subset", trainable="mlp"),
        "subset=mlp+nvfp4": C.UpdateContract(kind="subset", trainable="mlp", compression="nvfp4"),
    }.items():
        chosen = C.trainable_paths(contract, list(update), cfg.model.base_num_decoder_layers)
        payload, _, _ = C.encode({k: update[k] for k in chosen}, contract.compression)
        sent = C.payload_bytes(payload)
        out[name] = {"bytes_per_site": sent, "bits_per_value": 8 * sent / values,
                     "values_sent": sum(update[k].size for k in chosen), "values_in_model": values}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "federated.json"))
    a = p.parse_args()
    common = ["--sites", "3", "--rounds", str(a.rounds), "--slowdown", "1,2,4", "--samples-per-round", "48"]
    policies = {}
    for policy in ("equal", "static", "adaptive"):
        runs = [_summary(_run([*common, "--budget", policy], seed)["rounds"]) for seed in range(a.seeds)]
        policies[policy] = {"runs": runs, "makespan_median_after_round1_s": statistics.median(
            r["makespan_median_after_round1_s"] for r in runs)}
        print(f"{policy:9s} median makespan (rounds 2..) {policies[policy]['makespan_median_after_round1_s']:.2f} s",
              flush=True)
    base = policies["equal"]["makespan_median_after_round1_s"]
    for policy in ("static", "adaptive"):
        policies[policy]["reduction_vs_equal"] = 1 - policies[policy]["makespan_median_after_round1_s"] / base
    contracts = _contract_bytes()
    for name, v in contracts.items():
        print(f"{name:11s} {v['bytes_per_site'] / 1e6:.3f} MB a site a round ({v['bits_per_value']:.2f} bits a value)",
              flush=True)
    write_json(Path(a.out), {"environment": environment(), "model": MODEL, "slowdown": [1, 2, 4],
                             "policies": policies, "contracts": contracts,
                             "energy": "not measured (no power meter); --watts gives a stated model"})
    def draw(ax):
        for policy, v in policies.items():
            xs, ys = zip(*v["runs"][0]["loss_vs_makespan"])
            ax.plot(xs, ys, marker="o", label=policy)
        ax.set_xlabel("cumulative makespan (s)")
        ax.set_ylabel("global validation loss")

    save_plot(Path(a.out), draw)

if __name__ == "__main__":
    main()
