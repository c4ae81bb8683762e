"""`quantization_backend`: what each value resolves to, on which evidence, and what it builds."""

import pytest

from nvfp4_jax.quant import (
    BACKENDS,
    EMULATED,
    TE,
    NVFP4Backend,
    check_backend_resume,
    choose_backend,
    get_recipe,
    make_backend,
    scaled_matmul_reference,
    block_scaled_operand,
    xla_operand,
)
from nvfp4_jax.quant.xla_backend import ScaledMatmulGemm, ScaledMatmulProbe, block_scaled_operand_group

FUSED = ScaledMatmulProbe(True, True, "compiles to cuDNN's block-scaled FP4 GEMM on NVIDIA B200 (gpu)")
REWRITTEN = ScaledMatmulProbe(True, False, "lowers on NVIDIA H200 (gpu) as XLA's dequantize-then-dot rewrite")
ABSENT = ScaledMatmulProbe(False, False, "does not lower on cpu: NotImplementedError: ...")


def _probe(result):
    calls = []

    def probe():
        calls.append(1)
        return result

    probe.calls = calls
    return probe


def _no_te(recipe):
    raise AssertionError("TE must not be consulted")


@pytest.mark.parametrize(
    "probe, want",
    [(FUSED, "xla"), (REWRITTEN, "emulated"), (ABSENT, "emulated")],
)
def test_auto_takes_xla_only_onto_fp4_tensor_cores(probe, want):
    choice = choose_backend("auto", get_recipe("te_nvfp4"), probe=_probe(probe), check_te=_no_te)
    assert choice.name == want
    assert probe.detail in choice.reason and "auto never picks te" in choice.reason
    assert choice.line.startswith(f"quantization backend: {want} (auto: ")


@pytest.mark.parametrize("flag", ["te_fp8_delayedscaling", "te_fp8_currentscaling", "mxfp4", "mxfp4_nvfp4_recipe"])
def test_auto_emulates_what_xla_does_not_cover_without_probing(flag):
    probe = _probe(FUSED)
    choice = choose_backend("auto", get_recipe(flag), probe=probe, check_te=_no_te)
    assert choice.name == "emulated" and "covers NVFP4 only" in choice.reason
    assert probe.calls == []


def test_bf16_quantizes_nothing_whatever_is_asked():
    for requested in BACKENDS:
        choice = choose_backend(requested, get_recipe("bf16"), probe=_probe(ABSENT), check_te=_no_te)
        assert choice.name == "emulated" and "lax.dot_general" in choice.reason


def test_explicit_emulated_never_probes():
    probe = _probe(FUSED)
    assert choose_backend("emulated", get_recipe("te_nvfp4"), probe=probe, check_te=_no_te).name == "emulated"
    assert probe.calls == []


def test_explicit_xla():
    assert choose_backend("xla", get_recipe("te_nvfp4"), probe=_probe(FUSED)).name == "xla"
    # Without FP4 tensor cores only with the fallback flag (else an error: test_backend_fidelity).
    rewritten = choose_backend("xla", get_recipe("nvfp4_1d_weights"), probe=_probe(REWRITTEN), allow_xla_fallback=True)
    assert rewritten.name == "xla" and "dequantize-then-dot" in rewritten.reason
    with pytest.raises(ValueError, match="scaled_matmul does not lower on cpu.*use quantization_backend=auto"):
        choose_backend("xla", get_recipe("te_nvfp4"), probe=_probe(ABSENT))
    with pytest.raises(ValueError, match="quantization=te_fp8_delayedscaling is fp8"):
        choose_backend("xla", get_recipe("te_fp8_delayedscaling"), probe=_probe(FUSED))
    for flag in ("mxfp4", "mxfp4_nvfp4_recipe"):  # NVFP4's recipe does not make it NVFP4
        with pytest.raises(ValueError, match=f"quantization={flag} is mxfp4: use quantization_backend=auto"):
            choose_backend("xla", get_recipe(flag), probe=_probe(FUSED))


def test_explicit_te_asks_te_and_reports_its_version():
    asked = []

    def check(recipe):
        asked.append(recipe)
        return "2.14.0"

    choice = choose_backend("te", get_recipe("te_fp8_currentscaling"), probe=_probe(ABSENT), check_te=check)
    assert choice.name == "te" and "Transformer Engine 2.14.0" in choice.reason and len(asked) == 1


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"quantization_backend='cudnn'; choose one of \['auto'"):
        choose_backend("cudnn", get_recipe("te_nvfp4"))
    with pytest.raises(ValueError, match="no backend 'auto'"):
        make_backend("auto")


def test_make_backend():
    assert make_backend("emulated") is EMULATED
    assert make_backend("te") is TE
    with pytest.raises(ValueError, match="quantizes its own operands"):
        make_backend("te", operand=xla_operand)
    xla = make_backend("xla", scaled_matmul=scaled_matmul_reference)
    assert xla == NVFP4Backend("xla", block_scaled_operand, ScaledMatmulGemm(scaled_matmul_reference),
                               operand_group=block_scaled_operand_group)
    # Built alike, equal and hashing alike: one jit cache entry, not a retrace per build.
    assert xla == make_backend("xla", scaled_matmul=scaled_matmul_reference)
    assert hash(xla) == hash(make_backend("xla", scaled_matmul=scaled_matmul_reference))

    def pallas_like(x, spec, key=None):  # another quantizer with the emulated operand form
        raise NotImplementedError

    custom = make_backend("emulated", operand=pallas_like)
    assert custom.operand is pallas_like and custom.gemm is EMULATED.gemm


@pytest.mark.parametrize("flag", ["te_nvfp4", "te_nvfp4_no_rht", "te_fp8_currentscaling", "te_fp8_delayedscaling"])
def test_resume_across_emulated_and_xla_always_works(flag):
    check_backend_resume("emulated", "xla", get_recipe(flag))
    check_backend_resume("xla", "emulated", get_recipe(flag))
    check_backend_resume(None, "te", get_recipe(flag))  # a checkpoint from before backends were recorded
    check_backend_resume("te", "te", get_recipe(flag))


def test_resume_across_te_works_where_the_state_trees_agree():
    for flag in ("te_nvfp4", "nvfp4_1d_weights", "te_fp8_currentscaling"):
        check_backend_resume("te", "emulated", get_recipe(flag))
        check_backend_resume("xla", "te", get_recipe(flag))
    with pytest.raises(ValueError, match=r"written with quantization_backend=te and this run uses emulated.*"
                                         r"'_overwrite_with_gradient' vs 'fp8_meta'.*quantization_backend=te"):
        check_backend_resume("te", "emulated", get_recipe("te_fp8_delayedscaling"))
    with pytest.raises(ValueError, match="Resume with quantization_backend=xla"):
        check_backend_resume("xla", "te", get_recipe("te_fp8_delayedscaling"))
