"""Tokens/s of the `tiny` preset (te_nvfp4) on 1, 2, 4 and 8 virtual CPU devices, same global batch.

    python benchmarks/bench_scaling.py [--devices 1,2,4,8] [--global-batch 16] [--seq 128]
        [--quantization te_nvfp4] [--warmup 2] [--repeats 10] [--profile-steps 2] [--out PATH]

The devices are XLA's host-platform devices (`--xla_force_host_platform_device_count=8`, set
below before jax is imported). They all share this machine's CPU cores, so more devices cannot
make a step faster: this checks the overhead that FSDP adds (collectives, smaller per-device
GEMMs, synchronisation), not speed-up.

Each device count n runs the real train step (`build_model`, `make_optimizer`, `init_state`,
`make_train_step`, jitted with the state's shardings and donated state; see `_harness.py`) on
an FSDP mesh
(`ici_fsdp_parallelism=n`) of the first n devices, with per_device_batch_size = global / n.
After `--warmup` untimed steps (the first compiles), every repeat runs one step of each device
count in turn; a count's time is the median over repeats.

The collective share comes from a `jax.profiler` trace of `--profile-steps` more steps per
device count: the XLA:CPU runtime records one event per executed HLO op (its `hlo_op` and
`device_ordinal`); the share is the summed time of all-reduce / all-gather / reduce-scatter /
collective-permute / all-to-all ops over the summed time of all ops, over all devices. On CPU a
collective's time includes waiting at the rendezvous for the other devices, which here compete
for the same cores, so it bounds the communication cost from above.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from _report import environment, write_json  # noqa: E402
from _harness import StepCase, interleaved, traced_ops  # noqa: E402
from nvfp4_jax import sharding  # noqa: E402
from nvfp4_jax.config import make_config  # noqa: E402
from nvfp4_jax.train.build import build_model  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "scaling.json"
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
SHARED_CORES_NOTE = (
    "These {n} virtual CPU devices share this machine's {cores} CPU cores: this checks the "
    "overhead FSDP adds, not speed-up (more devices cannot make a step faster here)."
)


def _op_kind(hlo_op: str) -> str | None:
    name = hlo_op.split(".")[0]
    for kind in COLLECTIVES:
        if name.startswith(kind):  # also the async "-start"/"-done" halves
            return kind
    return None


def _case(n: int, args) -> StepCase:
    cfg = make_config({
        "model_name": "tiny", "quantization": args.quantization,
        "per_device_batch_size": args.global_batch // n, "max_target_length": args.seq,
        "dataset_type": "synthetic", "steps": 10_000, "ici_fsdp_parallelism": n,
    })
    mesh = sharding.make_mesh(cfg.mesh, devices=jax.devices()[:n])
    sharding.check_divisibility(cfg, mesh)
    return StepCase(cfg, mesh, build_model(cfg.model))


def collective_share(run: StepCase, steps: int) -> dict:
    """Profiles `steps` steps of `run`; the collectives' share of all op time (see the docstring)."""
    ops = traced_ops(run, steps)
    op_us = sum(us for _, _, us in ops)
    by_kind: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for hlo_op, _, us in ops:
        kind = _op_kind(hlo_op)
        if kind:
            by_kind[kind] += us
            count[kind] += 1
    collective_us = sum(by_kind.values())
    devices = len({device for _, device, _ in ops})
    return dict(
        profiled_steps=steps,
        devices_seen=devices,
        op_time_ms_per_step=round(op_us / steps / 1e3, 2),
        collective_time_ms_per_step=round(collective_us / steps / 1e3, 2),
        collective_share=round(collective_us / op_us, 4),
        by_kind_ms_per_step={k: round(v / steps / 1e3, 2) for k, v in sorted(by_kind.items())},
        count_per_device_per_step={k: v // (steps * devices) for k, v in sorted(count.items())},
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="1,2,4,8")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--quantization", default="te_nvfp4")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per count (the first compiles)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=2, help="0 skips the collective share")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    counts = [int(n) for n in args.devices.split(",") if n]
    available = len(jax.devices())
    for n in counts:
        if n > available or args.global_batch % n:
            ap.error(f"{n} devices: need n <= {available} and n dividing --global-batch {args.global_batch}")
    note = SHARED_CORES_NOTE.format(n=max(counts), cores=os.cpu_count())
    print(note)

    t0 = time.perf_counter()
    runs = [_case(n, args) for n in counts]
    interleaved(runs, args.warmup, args.repeats)

    tokens = args.global_batch * args.seq
    base = statistics.median(runs[0].times)
    rows = []
    for n, run in zip(counts, runs):
        med = statistics.median(run.times)
        row = dict(
            devices=n,
            per_device_batch_size=args.global_batch // n,
            median_step_s=round(med, 5),
            min_step_s=round(min(run.times), 5),
            tokens_per_s=round(tokens / med, 1),
            tokens_per_s_per_device=round(tokens / med / n, 1),
            step_time_vs_first=round(med / base, 3),
            first_step_s=round(run.first_step_s, 2),
            last_loss=round(run.loss, 4),
        )
        if args.profile_steps > 0:
            try:
                row["profile"] = collective_share(run, args.profile_steps)
            except Exception as e:  # report, never invent numbers
                row["profile"] = dict(error=f"{type(e).__name__}: {e}")
        rows.append(row)

    print(f"\ntiny, {args.quantization}, global batch {args.global_batch} x seq {args.seq} "
          f"= {tokens} tokens/step, FSDP over n devices")
    print(f"{'devices':>7s} {'batch/dev':>9s} {'median s':>9s} {'tokens/s':>9s} {'vs 1st':>7s} "
          f"{'collective share':>16s} {'coll. ms/step':>13s}")
    for r in rows:
        p = r.get("profile", {})
        share = f"{p['collective_share']:.1%}" if "collective_share" in p else p.get("error", "-")[:16]
        coll = f"{p['collective_time_ms_per_step']:.1f}" if "collective_share" in p else "-"
        print(f"{r['devices']:7d} {r['per_device_batch_size']:9d} {r['median_step_s']:9.4f} "
              f"{r['tokens_per_s']:9.0f} {r['step_time_vs_first']:7.2f} {share:>16s} {coll:>13s}")
    print(note)

    result = dict(
        command="python " + " ".join([os.path.relpath(__file__, Path.cwd())] + list(argv or sys.argv[1:])),
        note=note,
        collective_share_method=(
            "sum of XLA:CPU per-op trace events whose hlo_op is a collective, over the sum of all "
            "per-op events, all devices, from jax.profiler.trace(create_perfetto_trace=True); a "
            "collective's time includes waiting for the other devices at the rendezvous"
        ),
        model_name="tiny",
        quantization=args.quantization,
        global_batch=args.global_batch,
        seq=args.seq,
        tokens_per_step=tokens,
        warmup=args.warmup,
        repeats=args.repeats,
        **environment(),
        wall_s=round(time.perf_counter() - t0, 1),
        rows=rows,
    )
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
