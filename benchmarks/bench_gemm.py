"""Forward+backward of one linear layer per recipe, against BF16, in one run.

    python benchmarks/bench_gemm.py [--shapes 2048,1024,4096 4096,2048,8192] [--repeats 5] [--out PATH]

For each (tokens, K, N): `Y = X . W`, then dX and dW from a given dY, jitted, with bf16 X, W
and dY (the model's compute dtype). Cases: `bf16` (`lax.dot_general`), `te_fp8_currentscaling`,
`te_nvfp4_no_rht`, `te_nvfp4` (emulated). Timed interleaved (so load from other processes hits
every case alike), median of repeats, ratio to bf16.

Where the te_nvfp4 time goes, timed the same way:
- `nvfp4 quantize only`: the five operand quantizations of the recipe (X, W 2D, dY SR,
  X^T RHT, dY^T RHT+SR), nothing else;
- `  of which SR noise`: just the two `stochastic_rounding_bits(key, [T, N])` draws inside them;
- `nvfp4 GEMMs only`: the three bf16 x bf16 -> fp32 dots on ready operands, times alpha.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from _report import write_result  # noqa: E402

from nvfp4_jax.quant import get_recipe, make_dot_general, nvfp4_gemm_operand  # noqa: E402
from nvfp4_jax.quant.nvfp4_backend import sr_keys  # noqa: E402
from nvfp4_jax.quant.formats import stochastic_rounding_bits  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "gemm.json"
RECIPES = ("bf16", "te_fp8_currentscaling", "te_nvfp4_no_rht", "te_nvfp4")
DIMS = (((1,), (0,)), ((), ()))


def _fwd_bwd(dot):
    def run(x, w, g):
        y, vjp = jax.vjp(lambda x, w: dot(x, w, DIMS), x, w)
        return (y, *vjp(g))

    return run


def _quantize_only(key):
    def run(x, w, g):
        k_dgrad, k_wgrad = sr_keys(key)
        return (
            nvfp4_gemm_operand(x, axis=1),
            nvfp4_gemm_operand(w, axis=0, two_d=True),
            nvfp4_gemm_operand(g, axis=1, stochastic=True, key=k_dgrad),
            nvfp4_gemm_operand(x, axis=0, rht=True),
            nvfp4_gemm_operand(g, axis=0, rht=True, stochastic=True, key=k_wgrad),
        )

    return run


def _sr_noise_only(key):
    def run(x, w, g):
        return [stochastic_rounding_bits(k, g.shape) for k in sr_keys(key)]

    return run


def _gemms_only(x, w, g):
    def gemm(a, b, dims, dtype):
        acc = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
        return (acc * jnp.float32(1.5)).astype(dtype)

    return (
        gemm(x, w, DIMS, jnp.bfloat16),
        gemm(g, w, (((1,), (1,)), ((), ())), jnp.bfloat16),
        gemm(x, g, (((0,), (0,)), ((), ())), jnp.bfloat16),
    )


def _time(fns: dict, args, repeats: int) -> dict[str, list[float]]:
    jitted = {k: jax.jit(f) for k, f in fns.items()}
    for f in jitted.values():
        jax.block_until_ready(f(*args))  # compile + warm up
    times = {k: [] for k in jitted}
    for _ in range(repeats):
        for k, f in jitted.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t0)
    return times


def bench_shape(tokens: int, k: int, n: int, repeats: int) -> list[dict]:
    key = jax.random.PRNGKey(0)
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(kx, (tokens, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (tokens, n), jnp.float32).astype(jnp.bfloat16)
    fns = {name: _fwd_bwd(make_dot_general(get_recipe(name), key)) for name in RECIPES}
    fns["nvfp4 quantize only"] = _quantize_only(key)
    fns["  of which SR noise"] = _sr_noise_only(key)
    fns["nvfp4 GEMMs only"] = _gemms_only
    times = _time(fns, (x, w, g), repeats)
    bf16 = float(np.median(times["bf16"]))
    rows = []
    for name, ts in times.items():
        med = float(np.median(ts))
        rows.append(
            dict(
                shape=[tokens, k, n],
                case=name.strip(),
                median_ms=round(med * 1e3, 1),
                min_ms=round(float(np.min(ts)) * 1e3, 1),
                ratio_to_bf16=round(med / bf16, 3),
            )
        )
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["2048,1024,4096", "4096,2048,8192"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    load_before = os.getloadavg()
    rows = []
    for spec in args.shapes:
        tokens, k, n = (int(v) for v in spec.split(","))
        shape_rows = bench_shape(tokens, k, n, args.repeats)
        rows += shape_rows
        print(f"\n(tokens, K, N) = ({tokens}, {k}, {n}), fwd+bwd, median of {args.repeats}")
        print(f"{'case':26s} {'median ms':>10s} {'min ms':>9s} {'/ bf16':>7s}")
        for r, name in zip(shape_rows, (*RECIPES, "nvfp4 quantize only", "  of which SR noise", "nvfp4 GEMMs only")):
            print(f"{name:26s} {r['median_ms']:10.1f} {r['min_ms']:9.1f} {r['ratio_to_bf16']:7.2f}")
    return write_result(
        args.out, dict(repeats=args.repeats),
        load_average_before=[round(v, 2) for v in load_before],
        load_average_after=[round(v, 2) for v in os.getloadavg()],
        note="fwd+bwd of Y = X . W with bf16 X, W, dY; emulated recipes; ratio = median / bf16's "
        "median in the same run. 'quantize only' and 'GEMMs only' split te_nvfp4's time; "
        "'SR noise' is the part of 'quantize only' spent drawing the 8-bit random numbers.",
        rows=rows,
    )


if __name__ == "__main__":
    main()
