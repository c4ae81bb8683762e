"""Issue 17's backend fidelity: the BF16 kernel as MaxText + TE quantize it, one backend on every
process, no silent slow xla fallback, no silently ignored kernels, one NaN code pattern."""

import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backend_arithmetic import perturbed_arithmetic
from tolerance import error_statistic_rtol
from nvfp4_jax import kernels
from nvfp4_jax.config import ConfigError, load_config
from nvfp4_jax.quant import (
    NVFP4Backend,
    OperandSpec,
    choose_backend,
    emulated_gemm,
    gemm_operand,
    get_recipe,
    health,
    make_dot_general,
    quantize_nvfp4,
    resolve_backend,
    xla_operand,
)
from nvfp4_jax.quant.xla_backend import ScaledMatmulProbe
from nvfp4_jax.train import build

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIMS = (((1,), (0,)), ((), ()))
FUSED = ScaledMatmulProbe(True, True, "compiles to cuDNN's block-scaled FP4 GEMM on NVIDIA B200 (gpu)")
REWRITTEN = ScaledMatmulProbe(True, False, "lowers on NVIDIA H200 (gpu) as XLA's dequantize-then-dot rewrite (no FP4 tensor cores)")
ABSENT = ScaledMatmulProbe(False, False, "does not lower on cpu: NotImplementedError: ...")


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


# --- the kernel in the compute dtype --------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["te_nvfp4", pytest.param("nvfp4_1d_weights", marks=pytest.mark.slow),
                                    "te_fp8_currentscaling", pytest.param("mxfp4", marks=pytest.mark.slow)])
def test_bf16_kernel_quantizes_what_te_quantizes(recipe):
    ks = jax.random.split(jax.random.key(5), 4)
    x = jax.random.normal(ks[0], (32, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(ks[1], (64, 64)) * 0.05  # fp32 master kernel, not bf16-exact
    g = jax.random.normal(ks[2], (32, 64))
    key = ks[3]

    def fwd_bwd(w, kernel_dtype):
        def fn(x, w):
            dot = make_dot_general(get_recipe(recipe), key, kernel_dtype=kernel_dtype)
            return dot(x, w, DIMS, preferred_element_type=jnp.float32)

        y, vjp = jax.vjp(fn, x, w)
        return (y, *vjp(g))

    y, dx, dw = jax.jit(lambda w: fwd_bwd(w, jnp.bfloat16))(w)
    # TE's view: the kernel handed over in bf16 (MaxText casts it), quantized as is.
    y_te, dx_te, dw_te = jax.jit(lambda w: fwd_bwd(w.astype(jnp.bfloat16), None))(w)
    y_fp32, _, _ = jax.jit(lambda w: fwd_bwd(w, None))(w)
    np.testing.assert_array_equal(_bits(y), _bits(y_te))
    np.testing.assert_array_equal(_bits(dx), _bits(dx_te))
    # dW stays fp32 for the fp32 master (TE's is bf16: the same fp32 accumulator rounded once more).
    assert dw.dtype == jnp.float32 and dw_te.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(dw.astype(jnp.bfloat16)), _bits(dw_te))
    # ... and it is a real change from quantizing the fp32 kernel.
    assert not np.array_equal(_bits(y), _bits(y_fp32))


def test_the_weight_operand_has_the_codes_of_the_bf16_kernel():
    seen = {}

    def recording(x, spec, key=None):
        seen[spec.role] = x.dtype  # static at trace time
        return gemm_operand(x, spec, key)

    backend = NVFP4Backend("recording", recording, emulated_gemm)
    w = jax.random.normal(jax.random.key(1), (64, 48)) * 0.05
    x = jax.random.normal(jax.random.key(2), (32, 64))
    stats = health.init_stats(get_recipe("nvfp4_no_sr"))

    def fn(x, w, stats):
        return make_dot_general(get_recipe("nvfp4_no_sr"), backend=backend, quant_stats=stats,
                                kernel_dtype=jnp.bfloat16)(x, w, DIMS)

    _, vjp = jax.vjp(jax.jit(fn), x, w, stats)
    *_, measured = vjp(jnp.ones((32, 48)))
    assert seen["w"] == jnp.bfloat16 and seen["x"] == jnp.float32
    # The statistics of W are those of quantizing W.astype(bf16) with 16x16 tiles.
    want = jax.jit(lambda w: health.nvfp4_stats(w.astype(jnp.bfloat16), axis=0, two_d=True))(w)
    for name, value in want.items():
        # Counts and maxima are exact; the error norm's sums may fuse differently (two fp32
        # evaluations of the same sums: twice the bound of one).
        if name == "error":
            rtol = 2 * error_statistic_rtol(w.size)
            assert float(measured["w"][name]) == pytest.approx(float(value), rel=rtol, abs=0), name
        else:
            assert float(measured["w"][name]) == float(value), name
    # The amax the per-tensor scale comes from is the bf16 kernel's, not the fp32 master's.
    amax_bf16 = float(jnp.max(jnp.abs(w.astype(jnp.bfloat16))))
    assert float(measured["w"]["amax"]) == amax_bf16 != float(jnp.max(jnp.abs(w)))


def test_config_key_chooses_the_kernel_dtype():
    model = build.build_model(load_config(["quantization=te_nvfp4"]).model)
    assert model.mlp_dot_general_cls.kernel_dtype == "bfloat16"
    research = build.build_model(load_config(["quantization=te_nvfp4", "quantize_fp32_kernel=true"]).model)
    assert research.mlp_dot_general_cls.kernel_dtype is None
    fp8_attention = build.build_model(load_config(["quantization=te_nvfp4", "attention_quantization=fp8"]).model)
    assert fp8_attention.attention_dot_general_cls.kernel_dtype == "bfloat16"


# --- the explicit xla backend, and the kernels under it --------------------------------------------


def test_explicit_xla_without_fp4_tensor_cores_is_an_error_naming_emulated():
    with pytest.raises(ValueError, match=r"dequantize-then-dot rewrite .*slower than quantization_backend=emulated.*xla_dequantize_fallback=true") as err:
        choose_backend("xla", get_recipe("te_nvfp4"), probe=lambda: REWRITTEN)
    assert "\n" not in str(err.value)
    allowed = choose_backend("xla", get_recipe("te_nvfp4"), probe=lambda: REWRITTEN, allow_xla_fallback=True)
    assert allowed.name == "xla"
    assert choose_backend("xla", get_recipe("te_nvfp4"), probe=lambda: FUSED).name == "xla"


def test_config_error_on_this_machine():
    # On CPU, explicit xla is refused before anything compiles: with JAX 0.10 scaled_matmul does
    # not lower there at all; from 0.11 it lowers as XLA's dequantize-then-dot rewrite, which
    # has no FP4 tensor cores (refused unless the fallback is allowed).
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the CPU's refusal")
    lowers = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)
    why = "dequantize-then-dot rewrite" if lowers else "jax.nn.scaled_matmul does not lower"
    with pytest.raises(ConfigError, match=f"quantization_backend=xla: .*{why}"):
        build.quantization_backend(load_config(["quantization=te_nvfp4", "quantization_backend=xla"]).model)


@pytest.mark.parametrize("kernels_choice", ["pallas"])
def test_pallas_kernels_under_xla_are_refused(kernels_choice):
    with pytest.raises(ValueError, match=r"^quant_kernels=pallas: the xla backend quantizes its own operands") as err:
        resolve_backend("xla", get_recipe("te_nvfp4"), kernels_choice, probe=lambda: FUSED)
    assert "\n" not in str(err.value)
    # auto and jnp say what they do instead.
    for choice in ("auto", "jnp"):
        backend = resolve_backend("xla", get_recipe("te_nvfp4"), choice, probe=lambda: FUSED)
        assert backend.operands.startswith("jnp (the xla backend quantizes its own operands)")


# --- one backend on every process --------------------------------------------------------------------


def _processes(*outcomes):
    """A gather that reports these per-process probe outcomes (0 absent, 1 rewritten, 2 fused)."""
    return lambda mine: list(outcomes)


def test_processes_agree_on_the_weakest_probe():
    # Process 0's probe succeeds, process 1's fails: both end with emulated under auto ...
    auto = choose_backend("auto", get_recipe("te_nvfp4"), probe=lambda: FUSED, gather=_processes(2, 0))
    assert auto.name == "emulated" and "on process(es) [1] of 2" in auto.reason
    other = choose_backend("auto", get_recipe("te_nvfp4"), probe=lambda: ABSENT, gather=_processes(2, 0))
    assert other.name == "emulated"
    # ... and explicit xla is refused on both, naming the process.
    for probe in (FUSED, ABSENT):
        with pytest.raises(ValueError, match=r"does not lower on process\(es\) \[1\] of 2"):
            choose_backend("xla", get_recipe("te_nvfp4"), probe=lambda p=probe: p, gather=_processes(2, 0))
    # Agreement keeps the local result.
    assert choose_backend("auto", get_recipe("te_nvfp4"), probe=lambda: FUSED, gather=_processes(2, 2)).name == "xla"


def test_processes_that_cannot_exchange_fail_in_one_line():
    def broken(mine):
        raise RuntimeError("coordinator unreachable\nsecond line")

    with pytest.raises(ValueError, match=r"could not agree on the backend \(RuntimeError: coordinator unreachable\)") as err:
        choose_backend("auto", get_recipe("te_nvfp4"), probe=lambda: FUSED, gather=broken)
    assert "\n" not in str(err.value)


_WORKER = r"""
import sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from nvfp4_jax.quant import choose_backend, get_recipe
from nvfp4_jax.quant.xla_backend import ScaledMatmulProbe
# The xla probe stubbed to succeed on process 0 only.
ok = jax.process_index() == 0
probe = lambda: ScaledMatmulProbe(ok, ok, "stub " + ("fused" if ok else "absent"))
print("auto", choose_backend("auto", get_recipe("te_nvfp4"), probe=probe).name)
try:
    print("xla", choose_backend("xla", get_recipe("te_nvfp4"), probe=probe).name)
except ValueError as err:
    print("xla error", str(err).splitlines()[0])
"""


@pytest.mark.slow
def test_two_cpu_processes_end_with_one_backend():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, f"localhost:{port}", str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        lines = out.splitlines()
        assert "auto emulated" in lines
        assert any(line.startswith("xla error") and "process(es) [1] of 2" in line for line in lines), out


# --- a non-finite tensor's codes -------------------------------------------------------------------


NONFINITE_SPECS = [dict(axis=1), dict(axis=0, rht=True), dict(two_d=True), dict(axis=1, stochastic=True)]


def _nonfinite_codes(bad, kw):
    kw = dict(kw)
    if kw.get("stochastic"):
        kw["key"] = jax.random.key(0)
    x = jax.random.normal(jax.random.key(1), (32, 64)).at[3, 17].set(bad)
    q = jax.jit(lambda x: quantize_nvfp4(x, **kw))(x)
    op = jax.jit(lambda x: xla_operand(x, **kw))(x)
    return q, op


@pytest.mark.parametrize("arithmetic", ["ieee", "perturbed"])
@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf])
def test_nonfinite_codes_are_all_zero(arithmetic, bad):
    import contextlib

    scope = perturbed_arithmetic() if arithmetic == "perturbed" else contextlib.nullcontext()
    with scope:
        for kw in NONFINITE_SPECS:
            q, op = _nonfinite_codes(bad, kw)
            # The documented pattern: every code 0 (bytes 0x00), every scale NaN (0x7F).
            assert not np.asarray(q.codes).any(), kw
            assert (_bits(q.scales) == 0x7F).all(), kw
            for codes in op.codes:  # the xla backend's float4 operands: +0 everywhere
                assert (_bits(codes.astype(jnp.float32)) == 0).all(), kw


def test_nonfinite_codes_of_the_kernels_are_the_reference_pattern():
    x = jax.random.normal(jax.random.key(1), (32, 64)).at[3, 17].set(np.nan)
    for kw in (dict(axis=1), dict(axis=0, rht=True), dict(two_d=True)):
        got = kernels.quantize_nvfp4(x, **kw, interpret=True)
        assert not np.asarray(got.codes).any(), kw
        assert (_bits(got.scales) == 0x7F).all(), kw
