"""The plan command sizes the big presets without allocating them."""

import re

import pytest

from nvfp4_jax import flops, plan
from nvfp4_jax.cli import Exit
from nvfp4_jax.config import load_config


def _run(capsys, *argv):
    code = plan.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _number(text, label):
    return float(re.search(rf"{label}:\s+([\d,.]+)", text).group(1).replace(",", ""))


def test_llama3_8b_parameter_count_is_the_published_one(capsys):
    code, out, _ = _run(capsys, "model_name=llama3-8b", "ici_fsdp_parallelism=4")
    assert code == 0
    assert "parameters: 8,030,261,248" in out


def test_llama31_405b_parameter_count_within_half_a_percent(capsys):
    code, out, _ = _run(capsys, "model_name=llama3.1-405b", "--num-devices", "1024")
    assert code == 0
    assert abs(_number(out, "parameters") / 405.9e9 - 1) < 0.005


def test_fsdp_divides_parameter_and_optimizer_memory(capsys):
    cfg = load_config(["model_name=llama3-8b", "max_target_length=8192", "per_device_batch_size=4"])
    one = plan.make_plan(cfg, 1)
    eight = plan.make_plan(load_config(["model_name=llama3-8b", "ici_fsdp_parallelism=8",
                                        "max_target_length=8192", "per_device_batch_size=4"]), 8)
    assert one.parameter_bytes_per_device == pytest.approx(4 * 8_030_261_248)
    assert one.optimizer_bytes_per_device == pytest.approx(8 * 8_030_261_248)
    # Every matrix has an `embed` axis sharded over fsdp; only the norm scales are replicated.
    norm_params = (2 * 32 + 1) * 4096
    assert eight.parameter_bytes_per_device == 4 * ((8_030_261_248 - norm_params) / 8 + norm_params)
    # Activations depend on the per-device batch only.
    assert eight.activation_bytes_per_device == one.activation_bytes_per_device
    assert eight.flops_per_step == pytest.approx(8 * one.flops_per_step)
    assert one.flops_per_step == flops.training_flops_per_step(cfg.model, 4, 8192)


def test_plan_prints_flops_per_step(capsys):
    code, out, _ = _run(capsys, "model_name=llama3-8b", "ici_fsdp_parallelism=4",
                        "max_target_length=8192", "per_device_batch_size=4")
    cfg = load_config(["model_name=llama3-8b", "max_target_length=8192"])
    expected = flops.training_flops_per_step(cfg.model, 16, 8192)
    printed = float(re.search(r"model FLOPs per step: ([\d.e+]+)", out).group(1))
    assert printed == pytest.approx(expected, rel=1e-4)  # printed with 5 significant digits (.4e)


def test_plan_defaults_to_the_local_device_count(capsys):
    import jax

    # The test session has 8 virtual CPU devices; -1 (the default fsdp axis) takes them all.
    assert jax.device_count() == 8
    code, out, err = _run(capsys, "model_name=llama3-8b")
    assert code == 0, err
    assert "mesh: data=1 x fsdp=8 (8 devices)" in out


def test_plan_rejects_a_mesh_that_does_not_fit(capsys):
    code, _, err = _run(capsys, "model_name=llama3-8b", "ici_fsdp_parallelism=3", "--num-devices", "8")
    assert code == 2 and "Mesh does not match the devices" in err and "8 devices" in err


# --- the memory model: attention kernel, remat, scan, loss tiling, and the verdict -------------

GIB = 1024**3
EIGHT_B = ["recipes/configs/llama3-8b.yml", "ici_fsdp_parallelism=8"]
# llama3-8b at 8k context, 4 sequences per device.
N, T, D, F, H, G, K, V, L = 32, 4 * 8192, 4096, 14336, 32, 8, 128, 128256, 8192


def _plan(*overrides, memory_gib=None):
    cfg = load_config(EIGHT_B + list(overrides))
    return plan.make_plan(cfg, 8, None if memory_gib is None else memory_gib * GIB)


def test_the_llama3_8b_recipe_fits_eight_180_gib_gpus_with_room_to_spare(capsys):
    code, out, _ = _run(capsys, "recipes/configs/llama3-8b.yml", "--num-devices", "8",
                        "--device-memory-gib", "180")
    assert code == 0
    assert re.search(r"fits: yes, [\d.]+ GiB per device = \d+% of 180.0 GiB", out), out
    assert _plan(memory_gib=180).total_bytes_per_device < 0.5 * 180 * GIB


def test_a_plan_that_does_not_fit_says_so_and_how_to_shrink_it(capsys):
    # The recipe as it was before fused attention and remat: ~1 TiB of attention probabilities.
    code, out, _ = _run(capsys, *EIGHT_B, "attention=dot_product", "remat_policy=none",
                        "num_vocab_tiling=1", "--num-devices", "8", "--device-memory-gib", "180")
    assert code == Exit.DOES_NOT_FIT == 5  # its own code: 1 is a crash, 2 bad input
    assert "fits: NO" in out and "remat_policy=full" in out and "attention=cudnn_flash" in out
    assert _number(out, "saved activations") > 1024


def test_without_an_accelerator_or_a_size_the_verdict_is_unknown(capsys):
    code, out, _ = _run(capsys, *EIGHT_B, "--num-devices", "8")
    assert code == 0 and "fits: unknown" in out and "--device-memory-gib" in out


def test_dot_product_attention_keeps_fp32_probabilities_and_cudnn_a_log_sum_exp():
    common = ("remat_policy=none",)
    probs = _plan(*common, "attention=dot_product").saved_activation_bytes_per_device
    fused = _plan(*common, "attention=cudnn_flash").saved_activation_bytes_per_device
    assert probs - fused == N * T * 4 * H * (L - 1)


def test_remat_policies_save_what_their_names_say():
    a = 2  # bf16
    saved = {p: _plan(f"remat_policy={p}").saved_activation_bytes_per_device
             for p in ("full", "save_dot_except_mlp", "minimal", "minimal_with_context", "none")}
    assert saved["full"] == N * T * D * a  # each layer's input only
    assert saved["save_dot_except_mlp"] - saved["full"] == N * T * (D + H * K + 2 * G * K) * a
    assert saved["minimal"] - saved["save_dot_except_mlp"] == N * T * 2 * F * a
    assert saved["minimal_with_context"] - saved["minimal"] == N * T * H * K * a
    assert saved["minimal_with_context"] < saved["none"]
    # With remat, one layer is recomputed at a time on top of what is saved; without, nothing is.
    full, none = _plan("remat_policy=full"), _plan("remat_policy=none")
    assert full.working_set_bytes_per_device > none.working_set_bytes_per_device


def test_no_remat_counts_the_weights_the_quantized_dots_keep():
    nvfp4 = _plan("remat_policy=none", "quantization=te_nvfp4").saved_activation_bytes_per_device
    bf16 = _plan("remat_policy=none", "quantization=bf16").saved_activation_bytes_per_device
    fp8 = _plan("remat_policy=none", "quantization=te_fp8_delayedscaling").saved_activation_bytes_per_device
    assert nvfp4 - bf16 == N * 3 * D * F * 2  # NVFP4's 16x16-tiled W, kept as bf16 values
    assert fp8 - bf16 == N * 3 * D * F * 1


def test_loss_tiling_divides_the_logits_and_scan_gathers_two_layers_at_a_time():
    whole, tiled = _plan("num_vocab_tiling=1"), _plan("num_vocab_tiling=8")
    assert whole.working_set_bytes_per_device - tiled.working_set_bytes_per_device == T * 8 * V * (1 - 1 / 8)
    scanned, unrolled = _plan("scan_layers=true"), _plan("scan_layers=false")
    layer_weights = 3 * D * F + 2 * D * H * K + 2 * D * G * K
    assert unrolled.working_set_bytes_per_device - scanned.working_set_bytes_per_device == (N - 2) * layer_weights * 2
    assert unrolled.saved_activation_bytes_per_device == scanned.saved_activation_bytes_per_device
