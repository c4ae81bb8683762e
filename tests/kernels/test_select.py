"""The `quant_kernels` choice: what each value selects and says, the start-up self-check (and that
it catches a wrong kernel), the NVFP4 backend's fused-pair hook, and a quantized GEMM whose
operands come from the kernels giving the emulated GEMM's bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_same_bits

from nvfp4_jax import kernels
from nvfp4_jax.config import ConfigError, make_config
from nvfp4_jax.kernels import select
from nvfp4_jax.kernels.quantize import fused_quantize
from nvfp4_jax.quant import EMULATED, NVFP4Backend, gemm_operand, get_recipe, make_dot_general, nvfp4_gemm_operand
from nvfp4_jax.quant.spec import OperandSpec
from nvfp4_jax.train import build

DIMS = (((1,), (0,)), ((), ()))


def test_choices_on_cpu():
    jnp_choice = select.operand_kernels("jnp")
    assert jnp_choice.name == "jnp" and jnp_choice.operand is gemm_operand
    auto = select.operand_kernels("auto")
    assert auto.name == "jnp" and "need an NVIDIA GPU" in auto.reason
    pallas = select.operand_kernels("pallas")
    assert pallas.name == "pallas" and "interpreter" in pallas.reason
    assert pallas.operand.keywords == dict(interpret=True)
    with pytest.raises(ValueError, match=r"quant_kernels='triton' is not allowed: choose one of \['auto', 'pallas', 'jnp'\]"):
        select.operand_kernels("triton")


def test_config_key_and_startup_line():
    assert make_config({}).model.quant_kernels == "auto"
    with pytest.raises(ConfigError, match=r"quant_kernels='fast' is not allowed: choose one of"):
        make_config({"quant_kernels": "fast"})
    nvfp4 = make_config({"quantization": "te_nvfp4", "quant_kernels": "pallas"}).model
    backend = build.quantization_backend(nvfp4)  # emulated here (no GPU)
    assert build.quant_kernels_line(nvfp4, backend).startswith("NVFP4 operands: pallas (quant_kernels=pallas")
    assert backend.executor.operand.func is kernels.operand.spec_operand
    fp8 = make_config({"quantization": "te_fp8_currentscaling"}).model
    fp8_backend = build.quantization_backend(fp8)
    assert build.quant_kernels_line(fp8, fp8_backend) is None and fp8_backend.executor is EMULATED
    # The model's MLP dots carry the chosen backend.
    model = build.build_model(nvfp4, backend=backend)
    assert model.mlp_dot_general_cls.nvfp4_backend.name == "emulated+pallas"


def test_with_operand_kernels_keeps_the_gemm():
    def my_gemm(a, b, dims, out_dtype):  # e.g. another helper's GEMM backend
        return EMULATED.gemm(a, b, dims, out_dtype)

    base = NVFP4Backend("mine", gemm=my_gemm)
    both = select.with_operand_kernels(base, select.operand_kernels("pallas"))
    assert both.gemm is my_gemm and both.name == "mine+pallas" and both.operand_pair is not None
    assert select.with_operand_kernels(base, select.operand_kernels("jnp")) is base


def test_self_check_passes_and_catches_a_wrong_kernel():
    ok, message = select.self_check(interpret=True)
    assert ok, message

    def off_by_one_ulp(x, copies, keys, **kw):  # a kernel one bf16 ulp off on one copy
        out = fused_quantize(x, copies, keys, **kw)
        values, scale = out[3]
        bumped = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(values, jnp.uint16).at[0, 0].add(1), jnp.bfloat16)
        return out[:3] + [(bumped, scale)] + out[4:]

    ok, message = select.self_check(interpret=True, fused=off_by_one_ulp)
    assert not ok and "{'axis': 0}: 1 values differ" in message

    def crashing(*args, **kw):
        raise NotImplementedError("no Triton lowering for foo")

    ok, message = select.self_check(interpret=True, fused=crashing)
    assert not ok and "NotImplementedError: no Triton lowering for foo" in message


def test_backward_hands_dy_to_operand_pair_once():
    calls = []

    def pair(x, first, second):
        # The keys are tracers here; the outputs' equality below pins them (a swapped or shared
        # key would change the SR bits).
        calls.append((x.shape, first[0], second[0]))
        return gemm_operand(x, *first), gemm_operand(x, *second)

    recorder = NVFP4Backend("recorder", operand_pair=pair)
    key = jax.random.key(3)
    x, w, g = (jax.random.normal(k, s) for k, s in zip(jax.random.split(key, 3), ((32, 64), (64, 48), (32, 48))))

    def run(backend):
        def fn(x, w, g):
            y, vjp = jax.vjp(lambda a, b: make_dot_general(get_recipe("te_nvfp4"), key, backend=backend)(a, b, DIMS), x, w)
            return (y, *vjp(g))

        return jax.jit(fn)(x, w, g)

    got, want = run(recorder), run(EMULATED)
    [(shape, first, second)] = calls
    assert shape == g.shape
    assert first == OperandSpec("dy", axis=1, stochastic=True)
    assert second == OperandSpec("dy_wgrad", axis=0, rht=True, stochastic=True)
    assert_same_bits(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["te_nvfp4", "nvfp4_1d_weights"])
def test_quantized_gemm_with_kernel_operands_has_the_emulated_bits(recipe):
    # Forward and both gradients, with every operand (X, 2D or 1x16 W, dY's fused pair, X^T
    # with the RHT) from the interpreted kernels: the emulated backend's outputs, bit for bit.
    pallas = select.with_operand_kernels(EMULATED, select.operand_kernels("pallas"))
    key = jax.random.key(4)
    ks = jax.random.split(key, 3)
    x = jax.random.normal(ks[0], (32, 64), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(ks[1], (64, 48), jnp.float32) * 0.05
    g = jax.random.normal(ks[2], (32, 48), jnp.float32)

    def fwd_bwd(backend):
        def fn(x, w, g, key):
            dot = make_dot_general(get_recipe(recipe), key, backend=backend)
            y, vjp = jax.vjp(lambda a, b: dot(a, b, DIMS, preferred_element_type=jnp.float32), x, w)
            return (y, *vjp(g))

        return jax.jit(fn)(x, w, g, key)

    assert_same_bits(dict(zip(("y", "dx", "dw"), fwd_bwd(pallas), strict=True)),
                     dict(zip(("y", "dx", "dw"), fwd_bwd(EMULATED), strict=True)))
