"""The Python half of scripts/blackwell_smoke.sh: TE's version and support test, and one quantized
projection per recipe under te, xla and emulated, compared, with proof from the compiled HLO that
TE's or cuDNN's kernels ran.

    python scripts/blackwell_smoke.py [--cpu-dry-run]

`--cpu-dry-run` runs the same logic where there is no GPU: xla through the jnp stand-in of
jax.nn.scaled_matmul, te skipped (tests/scripts run it). Exit code 1 if any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nvfp4_jax.quant import (  # noqa: E402
    QuantDotGeneral, get_recipe, make_backend, quant_rngs, scaled_matmul_reference, te_backend,
)
from nvfp4_jax.quant.xla_backend import cudnn_block_scaled_gemm_in  # noqa: E402

RECIPES = ("te_nvfp4", "te_nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_1d_weights", "te_fp8_currentscaling")
# Relative Frobenius error of (y, dx, dw) against the emulated backend. xla: the same operands,
# fp32 accumulation order only. te: TE's own kernels (RHT and GEMM order, amax reduction) on
# the same recipe: quantization-level agreement, not bits.
TOLERANCE = {"xla": 2.0**-8, "te": 2.0**-4}
DIMS = (((2,), (0,)), ((), ()))


def kernel_ran(hlo_text: str, backend: str) -> bool:
    """Proof in compiled HLO text that the backend's own kernels run: TE's GEMM custom call for
    te, cuDNN's block-scaled GEMM for xla. (emulated: nothing to prove.)"""
    if backend == "te":
        return re.search(r'custom_call_target="te_gemm\w*"', hlo_text) is not None
    if backend == "xla":
        return cudnn_block_scaled_gemm_in(hlo_text)
    return True


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def projection(recipe: str, backend, x, w, g):
    """(y, dx, dw) of one quantized projection `x[B, L, K] . w[K, N]` through QuantDotGeneral,
    and the compiled HLO text of that jitted fwd+bwd."""
    mod = QuantDotGeneral(get_recipe(recipe), nvfp4_backend=backend)
    key = jax.random.PRNGKey(3)

    def fwd_bwd(x, w, g):
        variables = mod.init(quant_rngs(key), x, w, DIMS)
        f = lambda a, b: mod.apply(variables, a, b, DIMS, preferred_element_type=jnp.float32,  # noqa: E731
                                   rngs=quant_rngs(key))
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(g))

    jitted = jax.jit(fwd_bwd)
    return jitted(x, w, g), jitted.lower(x, w, g).compile().as_text()


def compare_backends(recipe: str, backends: dict, shape=(2, 256, 512, 768)) -> list[dict]:
    """One row per non-emulated backend: error vs emulated, within tolerance, kernel proof."""
    b, l, k, n = shape
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (b, l, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.float32) * 0.05
    g = jax.random.normal(keys[2], (b, l, n), jnp.float32)
    want, _ = projection(recipe, make_backend("emulated"), x, w, g)
    rows = []
    for name, backend in backends.items():
        got, hlo = projection(recipe, backend, x, w, g)
        err = max(relative_error(a, c) for a, c in zip(got, want))
        rows.append(dict(recipe=recipe, backend=name, rel_error=err, within=err <= TOLERANCE[name],
                         kernel_ran=kernel_ran(hlo, name)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args(argv)
    failed = 0
    print(f"jax {jax.__version__}; devices: {jax.devices()}")
    te_ok = {}
    for recipe in RECIPES:
        reason = te_backend.te_unavailable_reason(get_recipe(recipe))
        te_ok[recipe] = reason is None
        version = te_backend.te_version() if te_backend.te_available() else "not installed"
        print(f"TE {version}, {recipe}: {'supported' if reason is None else reason}")
    scaled_matmul = scaled_matmul_reference if args.cpu_dry_run else jax.nn.scaled_matmul
    for recipe in RECIPES:
        backends = {}
        if get_recipe(recipe).format == "nvfp4":
            backends["xla"] = make_backend("xla", scaled_matmul=scaled_matmul)
        if te_ok[recipe] and not args.cpu_dry_run:
            backends["te"] = make_backend("te")
        scope = (te_backend.mesh_resource_scope(dp_axis="data", fsdp_axis="fsdp")
                 if "te" in backends else contextlib.nullcontext())
        with scope:
            rows = compare_backends(recipe, backends)
        for r in rows:
            # On a CPU dry run the stand-in cannot show cuDNN's kernel; the error bound still holds.
            ok = r["within"] and (r["kernel_ran"] or args.cpu_dry_run)
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'}  {recipe} {r['backend']} vs emulated: relative error "
                  f"{r['rel_error']:.2e} (tolerance {TOLERANCE[r['backend']]:.1e}), kernel in HLO: {r['kernel_ran']}")
    print(f"blackwell_smoke (python part): {'all passed' if not failed else f'{failed} failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
