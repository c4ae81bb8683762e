"""Quantizer throughput against a device-to-device copy of the same tensor, in one run.

    python benchmarks/bench_quantize.py [--size 4096] [--repeats 15] [--dtypes float32,bfloat16]
                                        [--inner N] [--out PATH] [--previous PATH]

On a GPU, also the Pallas kernels (`nvfp4_jax.kernels`) beside the jnp cases; elsewhere they
would run in Pallas's interpreter, far too slow to time, and are left out (the table says so).
Every row gets `time_over_bound`: its time over the two-pass memory bound, the time a device
copy takes to move the bytes a two-pass quantizer must move (read x twice, write 0.5 B/element
of codes plus the scale bytes, or 2 B/element of bf16 values for an operand; both copies for a
pair). `--previous` (default: the results file about to be overwritten) adds each case's time
relative to that earlier run. GPU suite: `--size 8192 --dtypes bfloat16 --inner 20`.

Times (jitted, median of repeats, interleaved so that load from other processes hits every
case alike) NVFP4 1x16 RN / 1x16 SR / 2D / RHT, the unpacked GEMM operand, MXFP4, for float32
and bfloat16 inputs, plus `x.copy()`. Prints a table and writes JSON with the GB/s of input
read and the ratio to the copy's GB/s for the same dtype. Two reference rows: a read-only pass
(the tensor amax: what reading x once costs) and a straightforward jnp 1x16 RN quantizer
(float max-reductions, a division per element, comparison-sum rounding, strided packing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from _report import environment, write_json  # noqa: E402

from nvfp4_jax import kernels  # noqa: E402
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


# Bytes written per element, besides reading x twice: packed codes + 1x16 (or 16x16) scale
# bytes, or bf16 operand values. None: no bound (reference rows).
_PACKED, _PACKED_2D, _OPERAND = 0.5 + 1 / 16, 0.5 + 1 / 256, 2.0
_DY = (dict(axis=1, stochastic=True), dict(axis=0, rht=True, stochastic=True))


def _cases(with_kernels: bool):
    """name -> (fn(x, key), bytes written per element or None)."""
    cases = {
        "copy": (lambda x, k: x.copy(), None),
        "read-only pass (amax)": (lambda x, k: jnp.max(jnp.abs(x)), None),
        "naive jnp 1x16 RN": (lambda x, k: _naive_nvfp4(x), _PACKED),
        "nvfp4 1x16 RN": (lambda x, k: quantize_nvfp4(x), _PACKED),
        "nvfp4 1x16 SR": (lambda x, k: quantize_nvfp4(x, stochastic=True, key=k), _PACKED),
        "nvfp4 2D": (lambda x, k: quantize_nvfp4(x, two_d=True), _PACKED_2D),
        "nvfp4 RHT (axis 0)": (lambda x, k: quantize_nvfp4(x, axis=0, rht=True), _PACKED),
        "nvfp4 RHT+SR (axis 0)": (lambda x, k: quantize_nvfp4(x, axis=0, rht=True, stochastic=True, key=k), _PACKED),
        "operand 1x16 RN": (lambda x, k: nvfp4_gemm_operand(x), _OPERAND),
        "operand dY pair (SR + RHT SR)": (
            lambda x, k: tuple(nvfp4_gemm_operand(x, **kw, key=k) for kw in _DY), 2 * _OPERAND),
        "mxfp4": (lambda x, k: quantize_mxfp4(x), None),
    }
    if with_kernels:
        cases.update({
            "pallas 1x16 RN": (lambda x, k: kernels.quantize_nvfp4(x), _PACKED),
            "pallas 1x16 SR": (lambda x, k: kernels.quantize_nvfp4(x, stochastic=True, key=k), _PACKED),
            "pallas 2D": (lambda x, k: kernels.quantize_nvfp4(x, two_d=True), _PACKED_2D),
            "pallas RHT+SR (axis 0)": (
                lambda x, k: kernels.quantize_nvfp4(x, axis=0, rht=True, stochastic=True, key=k), _PACKED),
            "pallas dY pair packed (SR + RHT SR)": (
                lambda x, k: kernels.fused_quantize(
                    x, [kernels.Copy("rows", stochastic=True, packed=True),
                        kernels.Copy("cols", rht=True, stochastic=True, packed=True)], [k, k]),
                2 * _PACKED),
            "pallas operand 1x16 RN": (lambda x, k: kernels.gemm_operand(x), _OPERAND),
            "pallas operand dY pair (SR + RHT SR)": (
                lambda x, k: kernels.gemm_operand_pair(x, dict(_DY[0], key=k), dict(_DY[1], key=k)),
                2 * _OPERAND),
        })
    return cases


def _time(fns: dict, x, key, repeats: int, inner: int) -> dict[str, list[float]]:
    # The key is an argument: a constant key lets XLA constant-fold the noise.
    jitted = {k: jax.jit(f) for k, f in fns.items()}
    for f in jitted.values():
        jax.block_until_ready(f(x, key))  # compile + warm up
    times = {k: [] for k in jitted}
    for r in range(repeats):
        names = list(jitted)
        names = names[r % len(names):] + names[: r % len(names)]  # rotate: load hits all alike
        for k in names:
            f = jitted[k]
            t0 = time.perf_counter()
            out = [f(x, key) for _ in range(inner)]  # back to back
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / inner)
    return times


def _previous(path: Path) -> dict:
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    return {(r["case"], r["dtype"]): r["median_ms"] for r in rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--inner", type=int, default=None, help="calls per timing (default 1; 20 on GPU)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--previous", type=Path, default=None, help="earlier results (default: --out)")
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    inner = args.inner or (20 if on_gpu else 1)
    previous = _previous(args.previous or args.out)

    key = jax.random.key(0)
    rows = []
    for dtype in [jnp.dtype(d) for d in args.dtypes.split(",")]:
        x = jax.random.normal(jax.random.key(1), (args.size, args.size), jnp.float32).astype(dtype)
        nbytes = x.size * x.dtype.itemsize
        cases = _cases(on_gpu)
        times = _time({k: f for k, (f, _) in cases.items()}, x, key, args.repeats, inner)
        copy_s = float(np.median(times["copy"]))
        copy_Bps = 2 * nbytes / copy_s  # a copy reads and writes the tensor
        for name, ts in times.items():
            med = float(np.median(ts))
            writes = cases[name][1]
            bound = (2 * nbytes + writes * x.size) / copy_Bps if writes is not None else None
            prev = previous.get((name, dtype.name))
            rows.append(dict(
                case=name, dtype=dtype.name, median_ms=round(med * 1e3, 3),
                min_ms=round(float(np.min(ts)) * 1e3, 3),
                input_GBps=round(nbytes / med / 1e9, 3),
                ratio_to_copy=round(copy_s / med, 3),
                time_over_bound=round(med / bound, 3) if bound else None,
                vs_previous=round(med * 1e3 / prev, 3) if prev else None,
            ))

    print(f"{'case':38s} {'dtype':9s} {'median ms':>10s} {'min ms':>8s} {'GB/s in':>8s} {'/copy':>6s} "
          f"{'/bound':>7s} {'/prev':>6s}")
    fmt = lambda v, w: f"{v:{w}.2f}" if v is not None else f"{'-':>{w}s}"  # noqa: E731
    for r in rows:
        print(f"{r['case']:38s} {r['dtype']:9s} {r['median_ms']:10.2f} {r['min_ms']:8.2f} "
              f"{r['input_GBps']:8.2f} {r['ratio_to_copy']:6.2f} {fmt(r['time_over_bound'], 7)} "
              f"{fmt(r['vs_previous'], 6)}")
    if not on_gpu:
        print("Pallas kernels: not timed here (no GPU: they would run in Pallas's interpreter).")
    result = dict(
        shape=[args.size, args.size],
        repeats=args.repeats,
        inner=inner,
        **environment(),
        load_average=[round(v, 2) for v in os.getloadavg()],
        note="GB/s = input bytes / median time; ratio_to_copy = that over x.copy()'s GB/s for "
        "the same dtype, timed interleaved in the same run; time_over_bound = median time over "
        "the two-pass bound (2 reads of x + the case's writes, at the copy's bytes/s); "
        "vs_previous = median time over the previous results' median for the same case."
        + ("" if on_gpu else " Pallas kernels not timed: no GPU (interpreter only)."),
        rows=rows,
    )
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
