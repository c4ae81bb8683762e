"""The plan command sizes the big presets without allocating them."""

import re

import pytest

from nvfp4_jax import flops, plan
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
    assert printed == pytest.approx(expected, rel=1e-4)


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
