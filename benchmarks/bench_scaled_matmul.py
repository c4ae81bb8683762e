"""The xla backend's speed: te_nvfp4 fwd+bwd of one layer through jax.nn.scaled_matmul, beside
the emulated te_nvfp4 and plain bf16, in one run.

    python benchmarks/bench_scaled_matmul.py [--shape 8192,4096,14336] [--repeats 10] [--out PATH]

bf16 X, W and a random dY (never a constant: XLA would fold it); jitted, timed interleaved,
median of repeats, ratio to bf16. Where scaled_matmul does not lower (CPU) the xla case is
left out and the table says why; on a GPU the JSON records whether the compiled HLO holds
cuDNN's block-scaled FP4 GEMM (`fused_cudnn_fp4`). Default output:
benchmarks/results/gpu/scaled_matmul.json on an accelerator, benchmarks/results/ otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from _report import environment, write_json  # noqa: E402
from bench_gemm import _fwd_bwd, _time  # noqa: E402

from nvfp4_jax.quant import get_recipe, make_backend, make_dot_general, probe_scaled_matmul  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8192,4096,14336", help="tokens,K,N")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    tokens, k, n = (int(v) for v in args.shape.split(","))
    accel = jax.devices()[0]
    out = args.out or RESULTS / ("gpu" if accel.platform != "cpu" else "") / "scaled_matmul.json"

    key = jax.random.PRNGKey(0)
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(kx, (tokens, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (tokens, n), jnp.float32).astype(jnp.bfloat16)
    probe = probe_scaled_matmul(accel)
    fns = {
        "bf16": _fwd_bwd(make_dot_general(get_recipe("bf16"))),
        "te_nvfp4 emulated": _fwd_bwd(make_dot_general(get_recipe("te_nvfp4"), key)),
    }
    if probe.lowers:
        fns["te_nvfp4 xla"] = _fwd_bwd(make_dot_general(get_recipe("te_nvfp4"), key, backend=make_backend("xla")))
    times = _time(fns, (x, w, g), args.repeats)
    flops = 3 * 2 * tokens * k * n
    bf16 = float(np.median(times["bf16"]))
    rows = []
    print(f"(tokens, K, N) = ({tokens}, {k}, {n}), fwd+bwd, median of {args.repeats} on {accel}")
    print(f"{'case':20s} {'median ms':>10s} {'TFLOP/s':>8s} {'/ bf16':>7s}")
    for name, ts in times.items():
        med = float(np.median(ts))
        rows.append(dict(case=name, median_ms=round(med * 1e3, 2), tflops=round(flops / med / 1e12, 1),
                         ratio_to_bf16=round(med / bf16, 3)))
        print(f"{name:20s} {med * 1e3:10.2f} {flops / med / 1e12:8.1f} {med / bf16:7.2f}")
    print(f"xla backend: jax.nn.scaled_matmul {probe.detail}")
    result = dict(shape=[tokens, k, n], repeats=args.repeats, **environment(),
                  scaled_matmul=probe.detail, fused_cudnn_fp4=probe.fused, rows=rows)
    write_json(out, result)
    return result


if __name__ == "__main__":
    main()
