"""Quantizer throughput against a device-to-device copy of the same tensor, in one run.

    python benchmarks/bench_quantize.py [--size 4096] [--repeats 15] [--out PATH]

Times (jitted, median of repeats, interleaved so that load from other processes hits every
case alike) NVFP4 1x16 RN / 1x16 SR / 2D / RHT, the unpacked GEMM operand, MXFP4, for float32
and bfloat16 inputs, plus `x.copy()`. Prints a table and writes JSON with the GB/s of input
read and the ratio to the copy's GB/s for the same dtype. Two reference rows: a read-only pass
(the tensor amax: what reading x once costs) and a straightforward jnp 1x16 RN quantizer
(float max-reductions, a division per element, comparison-sum rounding, strided packing).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from _report import environment, write_json  # noqa: E402

from nvfp4_jax.quant import nvfp4_gemm_operand, quantize_mxfp4, quantize_nvfp4  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "quantize.json"


def _naive_nvfp4(x):
    """The straightforward jnp transcription of spec section 2 (numerically close, not exact)."""
    xb = x.astype(jnp.float32).reshape(x.shape[0], -1, 16)
    amax_b = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    s_enc = 2688.0 / jnp.max(amax_b)
    s_b = jnp.clip(amax_b * (s_enc / 6), 0, 448).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    y = jnp.clip(xb / (s_b / s_enc), -6, 6)
    a = jnp.abs(y)
    idx = sum((a > t).astype(jnp.uint8) for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
    codes = (idx | jnp.where(y < 0, 8, 0).astype(jnp.uint8)).reshape(x.shape)
    return codes[:, ::2] | (codes[:, 1::2] << 4), s_b.astype(jnp.float8_e4m3fn)


def _cases(key):
    return {
        "copy": lambda x: x.copy(),
        "read-only pass (amax)": lambda x: jnp.max(jnp.abs(x)),
        "naive jnp 1x16 RN": _naive_nvfp4,
        "nvfp4 1x16 RN": lambda x: quantize_nvfp4(x),
        "nvfp4 1x16 SR": lambda x: quantize_nvfp4(x, stochastic=True, key=key),
        "nvfp4 2D": lambda x: quantize_nvfp4(x, two_d=True),
        "nvfp4 RHT (axis 0)": lambda x: quantize_nvfp4(x, axis=0, rht=True),
        "operand 1x16 RN": lambda x: nvfp4_gemm_operand(x),
        "mxfp4": lambda x: quantize_mxfp4(x),
    }


def _time(fns: dict, x, repeats: int) -> dict[str, list[float]]:
    jitted = {k: jax.jit(f) for k, f in fns.items()}
    for f in jitted.values():
        jax.block_until_ready(f(x))  # compile + warm up
    times = {k: [] for k in jitted}
    for _ in range(repeats):
        for k, f in jitted.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            times[k].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    key = jax.random.key(0)
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(jax.random.key(1), (args.size, args.size), jnp.float32).astype(dtype)
        nbytes = x.size * x.dtype.itemsize
        times = _time(_cases(key), x, args.repeats)
        copy_gbs = nbytes / np.median(times["copy"]) / 1e9
        for name, ts in times.items():
            med = float(np.median(ts))
            gbs = nbytes / med / 1e9
            rows.append(
                dict(
                    case=name,
                    dtype=jnp.dtype(dtype).name,
                    median_ms=round(med * 1e3, 3),
                    min_ms=round(float(np.min(ts)) * 1e3, 3),
                    input_GBps=round(gbs, 3),
                    ratio_to_copy=round(gbs / copy_gbs, 3),
                )
            )

    print(f"{'case':24s} {'dtype':9s} {'median ms':>10s} {'min ms':>8s} {'GB/s in':>8s} {'/copy':>6s}")
    for r in rows:
        print(
            f"{r['case']:24s} {r['dtype']:9s} {r['median_ms']:10.2f} {r['min_ms']:8.2f} "
            f"{r['input_GBps']:8.2f} {r['ratio_to_copy']:6.2f}"
        )
    result = dict(
        shape=[args.size, args.size],
        repeats=args.repeats,
        **environment(),
        note="GB/s = input bytes / median time; ratio_to_copy = that over x.copy()'s GB/s "
        "for the same dtype, timed interleaved in the same run.",
        rows=rows,
    )
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
