"""This tree's quantizers against another revision's, interleaved call by call in one run.

    git archive fb5f34b | tar -x -C /tmp/nvfp4-base     # the revision to compare with
    python benchmarks/bench_quantize_vs_revision.py --baseline /tmp/nvfp4-base \\
        [--size 4096] [--rounds 41] [--dtypes float32,bfloat16] [--out PATH]

What `bench_quantize.py` times (NVFP4 1x16 RN / SR / 2D / RHT, the GEMM operand, MXFP4) plus
FP8 current scaling, through each revision's public `nvfp4_jax.quant` API. A results file from
an earlier day is no baseline on a shared machine (the same copy can take 1x or 2x as long from
one hour to the next); this runs both revisions side by side instead. Two packages named
nvfp4_jax cannot share a process, so each revision runs in its own worker process, which jits
every case once and then, per request, times one call of one case. The parent alternates
between the revisions call by call, reversing the order every round, so machine load hits both
alike; a case's time is the median over rounds, and `new/old` is the ratio of those medians (the
ratio of the minimums, the least disturbed calls, is reported beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE)]

from _report import environment, write_json  # noqa: E402
from _workers import Worker  # noqa: E402

OUT = HERE / "results" / "quantize_vs_revision.json"
CASES = ("nvfp4 1x16 RN", "nvfp4 1x16 SR", "nvfp4 2D", "nvfp4 RHT (axis 0)", "operand 1x16 RN",
         "mxfp4", "fp8 e4m3")


def _case_fns(quant, jnp, key):
    return {
        "nvfp4 1x16 RN": lambda x: quant.quantize_nvfp4(x),
        "nvfp4 1x16 SR": lambda x: quant.quantize_nvfp4(x, stochastic=True, key=key),
        "nvfp4 2D": lambda x: quant.quantize_nvfp4(x, two_d=True),
        "nvfp4 RHT (axis 0)": lambda x: quant.quantize_nvfp4(x, axis=0, rht=True),
        "operand 1x16 RN": lambda x: quant.nvfp4_gemm_operand(x),
        "mxfp4": lambda x: quant.quantize_mxfp4(x),
        "fp8 e4m3": lambda x: quant.quantize_fp8(x, jnp.float32(3.0)),
    }


def worker(root: str, size: int, dtypes: list[str]) -> None:
    """Jits every case of the package under `root`; then times one call per stdin line."""
    sys.path[:0] = [root]
    import jax
    import jax.numpy as jnp

    from nvfp4_jax import quant

    fns = {name: jax.jit(fn) for name, fn in _case_fns(quant, jnp, jax.random.PRNGKey(0)).items()}
    inputs = {d: jax.random.normal(jax.random.PRNGKey(1), (size, size), jnp.float32).astype(d) for d in dtypes}
    for x in inputs.values():
        for fn in fns.values():
            jax.block_until_ready(fn(x))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name, dtype = json.loads(line)
        t0 = time.perf_counter()
        jax.block_until_ready(fns[name](inputs[dtype]))
        print(json.dumps({"s": time.perf_counter() - t0}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="root of the revision to compare with (a `git archive` of it)")
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    dtypes = args.dtypes.split(",")
    if args.worker:
        worker(args.worker, args.size, dtypes)
        return
    if not args.baseline or not (Path(args.baseline) / "nvfp4_jax" / "quant").is_dir():
        p.error(f"--baseline={args.baseline!r} must be the root of a checkout holding nvfp4_jax/quant")

    worker_args = ["--size", str(args.size), "--dtypes", ",".join(dtypes)]
    roots = {"old": str(Path(args.baseline).resolve()), "new": str(ROOT)}
    workers = {rev: Worker(rev, root, __file__, ["--worker", root, *worker_args]) for rev, root in roots.items()}
    times = {(rev, c, d): [] for rev in workers for c in CASES for d in dtypes}
    try:
        for r in range(args.rounds):
            order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
            for d in dtypes:
                for c in CASES:
                    for rev in order:
                        times[rev, c, d].append(workers[rev].ask(json.dumps([c, d]))["s"])
    finally:
        for w in workers.values():
            w.close()

    rows = []
    print(f"{'case':22s} {'dtype':9s} {'old ms':>8s} {'new ms':>8s} {'new/old':>8s} {'min new/old':>12s}")
    for d in dtypes:
        for c in CASES:
            old, new = (statistics.median(times[rev, c, d]) * 1e3 for rev in ("old", "new"))
            old_min, new_min = (min(times[rev, c, d]) * 1e3 for rev in ("old", "new"))
            rows.append({"case": c, "dtype": d, "old_median_ms": round(old, 3), "new_median_ms": round(new, 3),
                         "new_over_old": round(new / old, 3), "old_min_ms": round(old_min, 3),
                         "new_min_ms": round(new_min, 3), "min_new_over_old": round(new_min / old_min, 3)})
            print(f"{c:22s} {d:9s} {old:8.2f} {new:8.2f} {new / old:8.3f} {new_min / old_min:12.3f}")
    write_json(Path(args.out), {
        "baseline": os.path.abspath(args.baseline), "shape": [args.size, args.size], "rounds": args.rounds,
        "note": "median of interleaved single calls per revision, each in its own worker process; "
                "new/old < 1 means this tree is faster",
        **environment(), "rows": rows,
    })


if __name__ == "__main__":
    main()
