"""The one builder: start-up decisions made once, recorded in checkpoints, compared on resume,
and the objects every program builds from them."""

import os

import jax
import pytest

from nvfp4_jax.bitwise import bit_diff
from nvfp4_jax.config import ConfigError, MeshConfig, load_config
from nvfp4_jax.quant.recipe import ATTENTION_FP8_FLAG
from nvfp4_jax.train import assembly, build, checkpoint
from nvfp4_jax.train.loop import run

TINY = ["model_name=tiny", "base_num_decoder_layers=1", "max_target_length=32", "per_device_batch_size=2",
        "ici_fsdp_parallelism=1", "eval_steps=1", "eval_interval=1000", "log_period=1"]


def _assembled(*keys, devices=None):
    return assembly.assemble(load_config(TINY + list(keys)), devices or jax.devices()[:1])


def test_startup_holds_every_decision_with_the_lines_the_builders_used_to_print():
    parts = _assembled("quantization=te_nvfp4", "attention_quantization=fp8", "quantization_end_step=5")
    s = parts.startup
    cfg = parts.cfg
    assert s.lines()[0] == build.describe_attention(cfg.model)
    assert s.lines()[1] == build.quantization_backend(cfg.model).line
    assert s.lines()[2] == build.quant_kernels_line(cfg.model, s.backend)
    assert s.record() == {
        "mlp_recipe": "te_nvfp4", "quantization_backend": "emulated", "operand_kernels": s.backend.operands,
        "kernel_dtype": "bfloat16", "attention_kernel": "dot_product",
        "attention_projections": ATTENTION_FP8_FLAG, "bf16_from_step": 5,
        "mesh": {"data": 1, "fsdp": 1, "context": 1, "tensor": 1}, "global_batch_size": 2,
        "trained_params": "all",
    }
    assert s.quantizes_anything
    assert _assembled("lora_rank=2").startup.record()["trained_params"] == "adapters"
    assert _assembled("lora_rank=2", "train_params=all").startup.record()["trained_params"] == "all"
    plain = _assembled("quantization=bf16", "quantize_fp32_kernel=true").startup
    assert plain.record()["kernel_dtype"] is None and plain.record()["bf16_from_step"] is None
    assert not plain.quantizes_anything
    # FP8 attention projections alone are a quantized forward too.
    assert _assembled("quantization=bf16", "attention_quantization=fp8").startup.quantizes_anything


def test_changes_from_names_each_decision_made_differently():
    s = _assembled("quantization=te_nvfp4").startup
    saved = s.record()
    assert s.changes_from(saved) == [] and s.changes_from(None) == []
    moved = dict(saved, attention_kernel="cudnn_flash", mesh={"data": 8, "fsdp": 1, "context": 1, "tensor": 1})
    assert s.changes_from(moved) == [
        ("attention_kernel", "cudnn_flash", "dot_product"),
        ("mesh", {"data": 8, "fsdp": 1, "context": 1, "tensor": 1}, {"data": 1, "fsdp": 1, "context": 1, "tensor": 1}),
    ]
    # An older record without some decision compares only what it has.
    assert s.changes_from({"attention_kernel": "dot_product"}) == []


def test_run_builds_the_same_state_and_steps_as_the_wiring_it_replaces():
    parts = _assembled("quantization=te_nvfp4")
    cfg = parts.cfg
    model = build.build_model(cfg.model)
    expected, expected_sh = build.init_state(model, parts.optimizer, cfg.model.max_target_length, parts.mesh,
                                             cfg.train.seed)
    state = parts.init_state()
    assert bit_diff(state, expected) == 0
    assert jax.tree.structure(parts.state_shardings) == jax.tree.structure(expected_sh)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), parts.abstract_state) == jax.tree.map(
        lambda a: (a.shape, a.dtype), state)
    batch = parts.put(parts.dataset("train").batch(0))
    quantized = float(parts.eval_step(state, batch))
    bf16 = float(parts.bf16_eval_step(state, batch))
    ref = float(build.jit_eval_step(model, parts.mesh, expected_sh)(expected, batch))
    assert quantized == ref
    assert bf16 != quantized  # the BF16 forward is another forward pass
    # Nothing quantized: the model is its own BF16 evaluation, never compiled twice.
    plain = _assembled("quantization=bf16")
    assert plain.bf16_eval_step is plain.eval_step
    assert plain.quant_stats_step is None


def test_with_optimizer_keeps_the_decisions_and_the_model():
    import optax

    parts = _assembled("quantization=te_nvfp4")
    other = parts.with_optimizer(optax.sgd(0.1))
    assert other.startup is parts.startup and other.mesh is parts.mesh
    assert jax.tree.structure(other.abstract_state.params) == jax.tree.structure(parts.abstract_state.params)
    assert jax.tree.structure(other.abstract_state.opt_state) != jax.tree.structure(parts.abstract_state.opt_state)


def test_restore_only_programs_skip_the_training_batch_check():
    cfg = load_config(TINY + ["per_device_batch_size=0.5"])  # a context-parallel run's batch
    with pytest.raises(ConfigError, match="global batch must be a whole number"):
        assembly.assemble(cfg, jax.devices()[:1])
    parts = assembly.assemble(cfg, jax.devices()[:1], mesh_config=MeshConfig(), check_batch=False)
    assert parts.startup.global_batch is None
    assert parts.abstract_state.params is not None


def test_checkpoints_record_the_startup_and_a_resume_names_what_changed(tmp_path, capsys):
    base = TINY + ["quantization=te_nvfp4", "checkpoint_period=2", "run_name=run",
                   f"base_output_directory={tmp_path}"]
    run(load_config(base + ["steps=2"]), progress=False, devices=jax.devices()[:1])
    manager = checkpoint.make_manager(os.path.join(tmp_path, "run", "checkpoints"), max_to_keep=3)
    record = checkpoint.read_record(manager, 2)
    manager.close()
    assert record["startup"] == _assembled("quantization=te_nvfp4").startup.record()
    capsys.readouterr()
    # The same run resumed on the same devices: the same decisions, no note.
    run(load_config(base + ["steps=3"]), progress=False, devices=jax.devices()[:1])
    out = capsys.readouterr().out
    assert "Resumed from checkpoint step 2" in out and "start-up decision" not in out
    # Two devices with half the rows each: the same global batch on another mesh, a decision a
    # resume may change; it is named.
    run(load_config(base + ["steps=4", "per_device_batch_size=1", "ici_data_parallelism=2"]), progress=False, devices=jax.devices()[:2])
    out = capsys.readouterr().out
    assert "Resumed from checkpoint step 3" in out
    assert ("note: start-up decision mesh was {'data': 1, 'fsdp': 1, 'context': 1, 'tensor': 1} at step 3, "
            "now {'data': 2, 'fsdp': 1, 'context': 1, 'tensor': 1}.") in out
