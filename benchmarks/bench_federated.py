"""Federated training in FLARE's simulator: equal vs static vs adaptive sample budgets, and the
bytes each update contract sends.

For each policy and seed it runs `python -m nvfp4_jax.federated` (3 sites whose compute is slowed
by 1x, 2x and 4x, the tiny model) and reads `federated.json`: per-round makespan (the slowest
site's busy time), each site's idle time at the round barrier, the coefficient of variation of
the sites' compute times, and the global validation loss against cumulative makespan. Then one
round per update contract (full / diff / diff+fp8 / diff+nvfp4 / subset=mlp) for the bytes sent.

    .venv/bin/python benchmarks/bench_federated.py [--rounds 5] [--seeds 2] [--out PATH]

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
from _report import environment, write_json  # noqa: E402

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
        "idle_mean_s": statistics.mean(idle), "compute_cv_mean": statistics.mean(r["compute_cv"] for r in trained),
        "final_validation_loss": rounds[-1]["validation_loss"], "loss_vs_makespan": curve,
        "budgets": [r["budgets"] for r in trained],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seeds", type=int, default=2)
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
    contracts = {}
    for name, extra in {"full": ["--update", "full"], "diff": ["--update", "diff"],
                        "diff+fp8": ["--compression", "fp8"], "diff+nvfp4": ["--compression", "nvfp4"],
                        "subset=mlp": ["--update", "subset", "--trainable", "mlp"]}.items():
        r = _run(["--sites", "3", "--rounds", "1", "--budget", "equal", "--samples-per-round", "12", *extra], 0)
        contracts[name] = {"bytes_per_round": r["rounds"][1]["bytes_sent"],
                           "validation_loss": r["rounds"][1]["validation_loss"]}
        print(f"{name:11s} {contracts[name]['bytes_per_round'] / 1e6:.3f} MB a round", flush=True)
    write_json(Path(a.out), {"environment": environment(), "model": MODEL, "slowdown": [1, 2, 4],
                             "policies": policies, "contracts": contracts,
                             "energy": "not measured (no power meter); --watts gives a stated model"})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for policy, v in policies.items():
            xs, ys = zip(*v["runs"][0]["loss_vs_makespan"])
            ax.plot(xs, ys, marker="o", label=policy)
        ax.set_xlabel("cumulative makespan (s)")
        ax.set_ylabel("global validation loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(a.out).with_suffix(".png"), dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
