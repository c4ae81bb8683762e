"""One-call numerics check on whatever accelerator JAX finds: same bits as the CPU, and the spec.

    python -m nvfp4_jax.device_check [--out DIR] [--quick] [--skip-kernels]

(`scripts/device_check.sh` runs it; tests/test_device_check.py runs its checks on CPU.) Every
check runs the same jitted function on the accelerator and on the CPU device of this process and
compares the results bit for bit (`nvfp4_jax.bitwise`); the quantizer checks also compare with
the numpy transcription of the numerical contract (docs/numerics.md) (`nvfp4_jax.nvfp4_spec`, IEEE float32 without
flushing), and the kernel checks use the kernels' own self-check comparison
(`nvfp4_jax.kernels.select.kernels_vs_reference`). One line per check, then a JSON report in DIR (default: $OUT,
else benchmarks/results/gpu/). Exit code 1 if any check fails.

Where the accelerator and the CPU may legitimately differ, the check says which side must match
what: XLA:CPU flushes float32 subnormals to zero, so on data with float32-subnormal elements the
CPU must match the spec with those elements read as zero where they are scaled, and the
accelerator (if it does not flush) the plain spec. GEMM outputs are compared within fp32
accumulation-order tolerance; their operands bitwise.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax import kernels
from nvfp4_jax.cli import CommandParser, Exit, debug_requested, fail, parse_command
from nvfp4_jax.bitwise import bit_diff
from nvfp4_jax.kernels.select import SELF_CHECK_COPIES, kernels_vs_reference
from nvfp4_jax.nvfp4_spec import ref_quantize, ref_rht_last_axis, spread_data, tie_rich_data
from nvfp4_jax.quant import (
    dequantize,
    exact,
    fp8_delayed,
    get_recipe,
    make_backend,
    make_dot_general,
    nvfp4_gemm_operand,
    probe_scaled_matmul,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
    scaled_matmul_reference,
    unpack_codes,
    xla_operand,
)
from nvfp4_jax.quant.formats import stochastic_rounding_bits


# --- running one function on both devices -------------------------------------------------------


@functools.lru_cache(maxsize=None)
def devices() -> tuple:
    """(accelerator, CPU): the default device and this process's CPU (the same on a CPU host)."""
    return jax.devices()[0], jax.devices("cpu")[0]


def on_device(fn, device, *args):
    args = jax.device_put(args, device)
    with jax.default_device(device):
        return jax.device_get(jax.jit(fn)(*args))


def on_both(fn, *args):
    accel, cpu = devices()
    return on_device(fn, accel, *args), on_device(fn, cpu, *args)


def _q_summary(q):
    return dict(codes=unpack_codes(q), scales=jax.lax.bitcast_convert_type(q.scales, jnp.uint8),
                amax=q.amax, values=dequantize(q))


# --- data ---------------------------------------------------------------------------------------


def datasets(quick: bool) -> dict[str, np.ndarray]:
    n = 128 if quick else 256
    rng = np.random.default_rng(0)
    tiny = np.asarray(spread_data(3, (64, 128), sigma=1.0), np.float32)
    tiny = (tiny / np.abs(tiny).max() * np.float32(1e-36)).astype(np.float32)
    tiny[np.abs(tiny) < np.finfo(np.float32).tiny] = 0
    sub = (rng.standard_normal((64, 128)) * 1e-38).astype(np.float32)
    sub[0, :16] = rng.standard_normal(16)
    return {
        "bf16 ties 1x16": tie_rich_data(0, (n, 2 * n)),
        "bf16 ties 2D": tie_rich_data(1, (n, 2 * n), two_d=True),
        "bf16 gaussian": np.asarray(jax.random.normal(jax.random.key(2), (n, 2 * n)), np.float32),
        "f32 wide range": np.asarray(spread_data(4, (n, 2 * n)), np.float32),
        "f32 tiny (amax 1e-36)": tiny,
        "f32 subnormal elements": sub,
    }


def _is_bf16(name):
    return name.startswith("bf16")


# --- checks -------------------------------------------------------------------------------------

NVFP4_VARIANTS = {
    "1x16 RN": dict(),
    "1x16 SR": dict(stochastic=True),
    "2D": dict(two_d=True),
    "axis 0 RN": dict(axis=0),
    "RHT axis 0 RN": dict(axis=0, rht=True),
    "RHT axis 0 SR": dict(axis=0, rht=True, stochastic=True),
}


def _spec_nvfp4(x: np.ndarray, kw: dict, key, flush: bool) -> dict:
    """The numpy spec's codes, scale bytes and amax for `quantize_nvfp4(x, **kw)`; `flush`:
    subnormal elements read as zero where scaled, as on a flushing backend."""
    axis0 = kw.get("axis") == 0
    xs = x.T if axis0 else x
    if kw.get("rht"):
        xs = np.asarray(ref_rht_last_axis(xs), np.float32)
    rbits = None
    if kw.get("stochastic"):
        rbits = np.asarray(stochastic_rounding_bits(key, x.shape))
        rbits = rbits.T if axis0 else rbits
    codes, sbytes, amax, _ = ref_quantize(xs, two_d=kw.get("two_d", False), rbits=rbits,
                                          flush_elements=flush)
    return dict(codes=codes.T if axis0 else codes, scales=sbytes.T if axis0 else sbytes, amax=amax)


def check_nvfp4(name, x, kw, key, accel_flushes):
    """Accelerator vs CPU vs spec. Float32 subnormals (among the elements, or for the RHT among
    its butterfly's sums of tiny values) are where a flushing backend (XLA:CPU) legitimately
    departs from the spec: elements read as zero where scaled; the RHT's sums flushed (no spec
    model for that, as XLA also contracts the butterfly's products into FMAs). A backend that
    does not flush must match the plain spec everywhere."""
    dtype = jnp.bfloat16 if _is_bf16(name) else jnp.float32
    xin = jnp.asarray(x, dtype)
    args = dict(kw, key=key) if kw.get("stochastic") else kw
    acc, cpu = on_both(lambda a: _q_summary(quantize_nvfp4(a, **args)), xin)
    x32 = np.asarray(xin.astype(jnp.float32))
    floor = np.finfo(np.float32).tiny * (2.0**12 if kw.get("rht") else 1.0)
    has_sub = bool(((np.abs(x32) < floor) & (x32 != 0)).any())
    drop = lambda d: {k: d[k] for k in ("codes", "scales", "amax")}  # noqa: E731
    detail = dict(accel_vs_cpu=bit_diff(drop(acc), drop(cpu)),
                  values_accel_vs_cpu=bit_diff(acc["values"], cpu["values"]))
    checks = [("accel_vs_cpu", not has_sub or accel_flushes)]
    checks.append(("values_accel_vs_cpu", accel_flushes or not (has_sub or "tiny" in name)))
    for side, out, flushes in (("accel", acc, accel_flushes), ("cpu", cpu, True)):
        if has_sub and flushes and kw.get("rht"):
            continue  # documented exception without a model
        detail[f"{side}_vs_spec"] = bit_diff(drop(out), _spec_nvfp4(x32, args, key, flushes and has_sub))
        checks.append((f"{side}_vs_spec", True))
    ok = all(detail[k] == 0 for k, required in checks if required)
    return ok, detail


def check_mxfp4(name, x):
    xin = jnp.asarray(x, jnp.bfloat16 if _is_bf16(name) else jnp.float32)
    acc, cpu = on_both(lambda a: quantize_mxfp4(a), xin)
    d = bit_diff(acc, cpu)
    return d == 0 or "subnormal" in name, dict(accel_vs_cpu=d)


def check_fp8(name, x, fmt):
    xin = jnp.asarray(x, jnp.bfloat16 if _is_bf16(name) else jnp.float32)

    def fn(a):
        amax = jnp.max(jnp.abs(a.astype(jnp.float32)))
        q = quantize_fp8(a, fp8_delayed.scale_from_amax(amax, fmt)[0], fmt)
        return dict(data=q.data, scale_inv=q.scale_inv, amax=q.amax)

    acc, cpu = on_both(fn, xin)
    d = bit_diff(acc, cpu)
    return d == 0 or "subnormal" in name or "tiny" in name, dict(accel_vs_cpu=d)


def check_exact_arithmetic():
    rng = np.random.default_rng(5)
    a = rng.integers(0, 2**32, 50000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    b = rng.integers(0, 2**32, 50000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(all="ignore"):
        want = dict(div=a / b, mul=a * b)
    acc, cpu = on_both(lambda p, q: dict(div=exact.div(p, q), mul=exact.mul(p, q)), a, b)

    def diff(got):
        n = 0
        for k in want:
            g, w = np.asarray(got[k]), want[k]
            nan = np.isnan(w)
            n += int((np.isnan(g) != nan).sum() + (g[~nan].view(np.uint32) != w[~nan].view(np.uint32)).sum())
        return n

    detail = dict(accel_vs_ieee=diff(acc), cpu_vs_ieee=diff(cpu))
    return detail["accel_vs_ieee"] == 0 and detail["cpu_vs_ieee"] == 0, detail


def check_fp8_delayed_update():
    meta = fp8_delayed.init_fp8_meta(16)
    amaxes = {"x": jnp.float32(3.7), "w": jnp.float32(0.0123), "dy": jnp.float32(1e-5)}

    def fn(m, a):
        for _ in range(3):
            m = fp8_delayed.next_fp8_meta(m, a, margin=1)
        return m

    acc, cpu = on_both(fn, meta, amaxes)
    d = bit_diff(acc, cpu)
    return d == 0, dict(accel_vs_cpu=d)


GEMM_RECIPES = ("te_nvfp4", "te_nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_1d_weights", "mxfp4", "mxfp4_nvfp4_recipe",
                "te_fp8_currentscaling", "te_fp8_delayedscaling")


def check_gemm(recipe, quick):
    t, k, n = (64, 128, 96) if quick else (256, 512, 384)
    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (t, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.float32) * 0.05  # fp32 master weight
    g = jax.random.normal(keys[2], (t, n), jnp.float32)  # a random dY, never a constant
    meta = fp8_delayed.init_fp8_meta(1024) if recipe == "te_fp8_delayedscaling" else None
    if meta is not None:  # a scale from a previous step, as in training
        meta = fp8_delayed.next_fp8_meta(meta, {"x": jnp.float32(4.0), "w": jnp.float32(0.2),
                                                "dy": jnp.float32(4.0)})

    def fn(x, w, g, key):
        dot = make_dot_general(get_recipe(recipe), key, fp8_meta=meta)
        dims = (((1,), (0,)), ((), ()))
        y, vjp = jax.vjp(lambda a, b: dot(a, b, dims, preferred_element_type=jnp.float32), x, w)
        dx, dw = vjp(g)
        ops = {}
        if recipe.startswith(("te_nvfp4", "nvfp4")):
            ops = dict(x=nvfp4_gemm_operand(x, axis=1), w=nvfp4_gemm_operand(w, axis=0, two_d=True),
                       g_sr=nvfp4_gemm_operand(g, axis=1, stochastic=True, key=key),
                       xt_rht=nvfp4_gemm_operand(x, axis=0, rht=True))
        return dict(y=y, dx=dx, dw=dw), ops

    (acc_out, acc_ops), (cpu_out, cpu_ops) = on_both(fn, x, w, g, keys[3])
    worst = 0.0
    for name in acc_out:
        a, c = np.asarray(acc_out[name], np.float64), np.asarray(cpu_out[name], np.float64)
        worst = max(worst, float(np.abs(a - c).max() / max(np.abs(c).max(), 1e-30)))
    ops_diff = bit_diff(acc_ops, cpu_ops)
    detail = dict(operands_accel_vs_cpu=ops_diff, max_output_rel_diff=worst)
    return ops_diff == 0 and worst < 1e-4, detail


def check_xla_gemm(recipe, quick):
    """The xla backend (real jax.nn.scaled_matmul) against the emulated one on the accelerator:
    every operand it hands scaled_matmul bitwise the emulated operand, outputs and gradients
    within fp32 accumulation order (bf16 rounding for bf16 results)."""
    accel = devices()[0]
    probe = probe_scaled_matmul(accel)
    # Where it does not lower (CPU dry run), the check runs its logic on the jnp stand-in.
    scaled_matmul = jax.nn.scaled_matmul if probe.lowers else scaled_matmul_reference
    t, k, n = (64, 128, 96) if quick else (512, 1024, 768)
    keys = jax.random.split(jax.random.key(8), 4)
    x = jax.random.normal(keys[0], (2, t // 2, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.float32) * 0.05
    g = jax.random.normal(keys[2], (2, t // 2, n), jnp.float32)
    xla = make_backend("xla", scaled_matmul=scaled_matmul)
    dims = (((2,), (0,)), ((), ()))

    def fn(x, w, g, key):
        outs = []
        for backend in (xla, make_backend("emulated")):
            dot = make_dot_general(get_recipe(recipe), key, backend=backend)
            y, vjp = jax.vjp(lambda a, b: dot(a, b, dims, preferred_element_type=jnp.float32), x, w)
            outs.append((y, *vjp(g)))
        x2 = x.reshape(t, k)
        ops = {}
        for name, a, kw in (("x", x2, dict(axis=1)), ("w", w, dict(axis=0, two_d=True)),
                            ("xt_rht", x2, dict(axis=0, rht=True))):
            op = xla_operand(a, **kw)
            codes, scales = op.view(kw["axis"])
            deq = codes.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), 16, axis=-1)
            want = nvfp4_gemm_operand(a, **kw)[0].astype(jnp.float32)
            ops[name] = (deq, want.T if kw["axis"] == 0 else want)
        return outs, ops

    with jax.default_device(accel):
        (got, want), ops = jax.device_get(jax.jit(fn)(*jax.device_put((x, w, g, keys[3]), accel)))
    worst = 0.0
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
    ops_diff = sum(bit_diff(a, b) for a, b in ops.values())
    detail = dict(scaled_matmul="jax.nn.scaled_matmul" if probe.lowers else f"jnp stand-in ({probe.detail})",
                  fused_cudnn_fp4=probe.fused, operands_xla_vs_emulated=ops_diff, max_output_rel_diff=worst)
    return ops_diff == 0 and worst < 2.0**-8, detail


# The dY pair in its storage form (packed codes), beside the operand copies.
PACKED_DY_PAIR = (
    (kernels.Copy("rows", stochastic=True, packed=True), dict(axis=1, stochastic=True)),
    (kernels.Copy("cols", rht=True, stochastic=True, packed=True), dict(axis=0, rht=True, stochastic=True)),
)


def check_kernels(name, x, key):
    """The Pallas kernels (Triton on a GPU; interpreted on the CPU) against the jnp reference on
    the same device, bit for bit: every GEMM-operand copy in one fused call, and the packed form
    of the dY pair. Scales and amax must match everywhere; codes and values too, except that on
    data with float32 subnormals the CPU (which flushes them) is exempt for RHT copies
    (docs/numerics.md). Non-finite data is not in `datasets`; the interpreted tests cover it."""
    xin = jnp.asarray(x, jnp.bfloat16 if _is_bf16(name) else jnp.float32)
    copies = list(SELF_CHECK_COPIES) + list(PACKED_DY_PAIR)
    keys = [jax.random.fold_in(key, i) for i in range(len(copies))]
    x32 = np.asarray(xin.astype(jnp.float32))
    tiny_sums = bool(((np.abs(x32) < np.finfo(np.float32).tiny * 2.0**12) & (x32 != 0)).any())
    detail, ok = {}, True
    for side, device in zip(("accel", "cpu"), devices()):
        with jax.default_device(device):
            diffs = kernels_vs_reference(jax.device_put(xin, device), copies, keys,
                                         interpret=device.platform != "gpu")
        exempt = tiny_sums and device.platform == "cpu"
        for (copy, kw), d in zip(copies, diffs):
            detail[f"{side} {'packed ' if copy.packed else ''}{kw}"] = d
            ok &= d == 0 or (exempt and (copy.rht or copy.packed))
    return ok, detail


def check_kernel_selection():
    """What `quant_kernels=auto` picks on this machine, and the start-up self-check's verdict."""
    choice = kernels.operand_kernels("auto")
    ok, message = kernels.self_check(interpret=devices()[0].platform != "gpu")
    return ok, dict(auto=choice.name, reason=choice.reason, self_check=message)


# --- driver -------------------------------------------------------------------------------------


def _parser() -> CommandParser:
    ap = CommandParser("device_check")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="smaller tensors (for a CPU dry run)")
    ap.add_argument("--skip-kernels", action="store_true", help="leave out the Pallas kernel checks")
    return ap


def main(argv=None) -> int:
    try:
        args = parse_command(_parser(), argv, __doc__, help_when_empty=False)
    except ValueError as exc:  # a usage mistake: one line, exit 2
        return fail(exc, Exit.BAD_INPUT, debug=debug_requested(argv))
    if args is None:
        return Exit.OK
    out_dir = args.out or Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu")
    accel, cpu = devices()

    accel_flushes = bool(on_device(lambda v: v * np.float32(2.0**30), accel, np.float32(1e-40)) == 0)
    header = (f"device_check: accelerator {accel} ({accel.platform}), CPU {cpu}; jax {jax.__version__}; "
              f"accelerator flushes float32 subnormals: {accel_flushes}")
    if accel.platform == "cpu":
        header += " (no accelerator found: the CPU is compared with itself and with the spec)"
    print(header, flush=True)

    results = []

    def record(name, fn, *fargs):
        t0 = time.perf_counter()
        try:
            ok, detail = fn(*fargs)
        except Exception as exc:  # a crash is a failed check, and the others still run
            ok, detail = False, dict(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-1500:])
        detail["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(dict(check=name, ok=bool(ok), **detail))
        shown = {k: v for k, v in detail.items() if k != "trace"}
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {shown}", flush=True)

    record("exact float32 div/mul vs IEEE", check_exact_arithmetic)
    key = jax.random.key(11)
    for dname, x in datasets(args.quick).items():
        for vname, kw in NVFP4_VARIANTS.items():
            if "2D" in dname and "2D" not in vname:
                continue
            record(f"nvfp4 {vname} on {dname}", check_nvfp4, dname, x, kw, key, accel_flushes)
        record(f"mxfp4 on {dname}", check_mxfp4, dname, x)
        for fmt in ("e4m3", "e5m2"):
            record(f"fp8 {fmt} current scaling on {dname}", check_fp8, dname, x, fmt)
    record("fp8 delayed-scaling state update", check_fp8_delayed_update)
    if not args.skip_kernels:
        record("Pallas kernels: quant_kernels=auto and the self-check", check_kernel_selection)
        for dname, x in datasets(args.quick).items():
            if args.quick and dname not in ("bf16 ties 1x16", "f32 subnormal elements"):
                continue  # the interpreted kernels compile slowly on a CPU
            record(f"Pallas kernels vs jnp on {dname}", check_kernels, dname, x, key)
    for recipe in GEMM_RECIPES:
        record(f"emulated GEMM {recipe}", check_gemm, recipe, args.quick)
    for recipe in ("te_nvfp4", "nvfp4_1d_weights"):
        record(f"xla GEMM (jax.nn.scaled_matmul) vs emulated, {recipe}", check_xla_gemm, recipe, args.quick)

    failed = [r["check"] for r in results if not r["ok"]]
    report = dict(
        accelerator=str(accel), platform=accel.platform,
        device_kind=getattr(accel, "device_kind", ""), jax=jax.__version__,
        machine=platform.machine(), accelerator_flushes_subnormals=accel_flushes,
        passed=len(results) - len(failed), failed=len(failed), checks=results,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "device_check.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"device_check: {len(results) - len(failed)} passed, {len(failed)} failed; report: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
