"""The Blackwell projection against NVIDIA's published MaxText NVFP4-over-FP8 speedups, and its
internal consistency. Nothing in nvfp4_jax/projection.py is fitted to these rows."""

import subprocess
import sys

import pytest

from nvfp4_jax.config import load_config
from nvfp4_jax.projection import DEVICES, FP4_GEMM_EFFICIENCY_BOUNDS, GEMM_EFFICIENCY, RECIPES, project

# NVIDIA's MaxText NVFP4 results: Llama 3 8B / Llama 3.1 405B, FSDP, seq 8192, batch 4 per GPU,
# NVFP4 MLP GEMMs, attention in higher precision. (model, device, published speedup, GPUs)
PUBLISHED = [
    ("llama3-8b", "gb200", 1.31, 8),
    ("llama3-8b", "gb300", 1.39, 8),
    ("llama3.1-405b", "gb200", 1.44, 64),
    ("llama3.1-405b", "gb300", 1.73, 64),
]


def _estimates(model, device, gpus, batch=4, seq=8192):
    cfg = load_config([f"model_name={model}"]).model
    return project(cfg, DEVICES[device], per_device_batch=batch, seq_len=seq, num_devices=gpus)


@pytest.mark.parametrize("model, device, published, gpus", PUBLISHED)
def test_reproduces_the_published_speedups_within_9_percent(model, device, published, gpus):
    # The README's figure: every row's point projection within 9% (they are 2.5-8.3% low).
    e = _estimates(model, device, gpus)
    speedup = e["te_fp8_delayedscaling"].seconds / e["te_nvfp4"].seconds
    assert -0.09 < speedup / published - 1 < 0.0, (model, device, speedup, published)


def test_the_fp4_efficiency_band_moves_the_four_speedups_by_minus_15_to_plus_5_percent():
    offsets = []
    for model, device, published, gpus in PUBLISHED:
        e = _estimates(model, device, gpus)
        slow, fast = e["te_nvfp4"].band
        assert slow > e["te_nvfp4"].seconds > fast  # the point lies inside its band
        # The band is the projection at the bounds, and only the MLP GEMMs move with it.
        lo = project(load_config([f"model_name={model}"]).model, DEVICES[device], per_device_batch=4, seq_len=8192,
                     num_devices=gpus, fp4_gemm_efficiency=FP4_GEMM_EFFICIENCY_BOUNDS[0])
        assert lo["te_nvfp4"].seconds == pytest.approx(slow) and lo["te_fp8_delayedscaling"].seconds == pytest.approx(e["te_fp8_delayedscaling"].seconds)
        assert lo["te_nvfp4"].terms["MLP GEMMs"] == pytest.approx(
            e["te_nvfp4"].terms["MLP GEMMs"] * GEMM_EFFICIENCY / FP4_GEMM_EFFICIENCY_BOUNDS[0])
        offsets += [e["te_fp8_delayedscaling"].seconds / slow / published - 1, e["te_fp8_delayedscaling"].seconds / fast / published - 1]
    assert -0.15 < min(offsets) < -0.14 and 0.04 < max(offsets) < 0.05
    # Without FP4 tensor cores the efficiency of FP4 GEMMs does not enter: the band is a point.
    h = _estimates("llama3-8b", "h200", 8)["te_nvfp4"]
    assert h.band == pytest.approx((h.seconds, h.seconds))


def test_terms_are_consistent():
    e = _estimates("llama3-8b", "gb200", 8)
    assert set(e) == set(RECIPES)
    for est in e.values():
        assert est.seconds == pytest.approx(sum(est.terms.values()))
    # Only the MLP GEMMs and the quantizers differ between recipes; FP4 halves FP8's GEMM time.
    assert e["te_fp8_delayedscaling"].terms["MLP GEMMs"] == pytest.approx(2 * e["te_nvfp4"].terms["MLP GEMMs"])
    assert e["bf16"].terms["MLP GEMMs"] == pytest.approx(2 * e["te_fp8_delayedscaling"].terms["MLP GEMMs"])
    assert e["bf16"].terms["quantization"] == 0 < e["te_nvfp4_no_rht"].terms["quantization"] < e["te_nvfp4"].terms["quantization"]
    for name in ("attention projections", "attention core", "LM head", "elementwise"):
        assert len({est.terms[name] for est in e.values()}) == 1
    # GB300 differs from GB200 only in its FP4 rate.
    e300 = _estimates("llama3-8b", "gb300", 8)
    assert e300["te_fp8_delayedscaling"].seconds == pytest.approx(e["te_fp8_delayedscaling"].seconds) and e300["te_nvfp4"].seconds < e["te_nvfp4"].seconds


def test_hopper_runs_nvfp4_at_the_bf16_rate():
    e = _estimates("llama3-8b", "h200", 8)
    assert e["te_nvfp4"].terms["MLP GEMMs"] == pytest.approx(e["bf16"].terms["MLP GEMMs"])
    assert e["te_nvfp4"].seconds > e["bf16"].seconds


def test_plan_prints_the_projection():
    out = subprocess.run(
        [sys.executable, "-m", "nvfp4_jax.plan", "model_name=llama3-8b", "max_target_length=8192",
         "per_device_batch_size=4", "--num-devices", "8", "--project", "gb300"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "projected step time on GB300" in out.stdout
    assert ("projected NVFP4 (te_nvfp4) over FP8 speedup: 1.31x (range 1.24x-1.34x for FP4 GEMM "
            "efficiency 0.45-0.70") in out.stdout
