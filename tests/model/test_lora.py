"""LoRA adapters beside frozen (and quantized) projections: the low-rank path's arithmetic, a
frozen backbone that gets no weight gradient and no optimizer state, loading a backbone into an
adapted run, merging adapters for export, and the keys' errors."""

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nvfp4_jax.config import ConfigError, load_config
from nvfp4_jax.model import lora
from nvfp4_jax.model.layers import Dense
from nvfp4_jax.train import assembly
from nvfp4_jax.train import params_checkpoint as params_lib
from nvfp4_jax.train.step import _loss

ONE_DEVICE = jax.devices()[:1]
TINY = ["model_name=tiny", "base_num_decoder_layers=2", "max_target_length=32", "per_device_batch_size=2",
        "learning_rate=1e-2", "warmup_steps_fraction=0", "scan_layers=true"]
TOKENS = jax.random.randint(jax.random.PRNGKey(1), (2, 33), 0, 256)
BATCH = {"inputs": TOKENS[:, :-1], "targets": TOKENS[:, 1:]}


def _run(*extra):
    return assembly.assemble(load_config(TINY + list(extra)), ONE_DEVICE)


def _adapter_leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
            if lora._is_adapter(p)}


def test_the_low_rank_path_adds_alpha_over_r_x_a_b_to_the_projection_in_float64_terms():
    dense = Dense(6, ("embed", "mlp"), jnp.float32, lora_rank=3, lora_scale=0.5)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 5))
    params = nn.meta.unbox(dense.init(jax.random.PRNGKey(1), x)["params"])
    # B starts at zero: the adapted projection starts as the plain one, bit for bit.
    assert not np.asarray(params["lora_b"]).any()
    plain = Dense(6, ("embed", "mlp"), jnp.float32).apply({"params": {"kernel": params["kernel"]}}, x)
    np.testing.assert_array_equal(dense.apply({"params": params}, x), plain)
    params = {**params, "lora_b": jax.random.normal(jax.random.PRNGKey(2), (3, 6))}
    w, a, b = (np.asarray(params[k], np.float64) for k in ("kernel", "lora_a", "lora_b"))
    want = np.asarray(x, np.float64) @ w + 0.5 * (np.asarray(x, np.float64) @ a) @ b
    np.testing.assert_allclose(dense.apply({"params": params}, x), want, rtol=2e-6, atol=2e-6)


def test_only_the_targeted_projections_get_adapters_of_the_given_rank():
    run = _run("lora_rank=4", "lora_targets=query,down")
    shapes = jax.tree.map(lambda a: a.shape, run.abstract_state.params["layers"])
    assert shapes["attention"]["query"]["lora_a"] == (2, 128, 4)  # stacked over the 2 layers
    assert shapes["attention"]["query"]["lora_b"] == (2, 4, 128)
    assert shapes["mlp"]["down"]["lora_a"] == (2, 384, 4)
    assert "lora_a" not in shapes["attention"]["key"] and "lora_a" not in shapes["mlp"]["gate"]


@pytest.mark.slow
def test_a_frozen_nvfp4_backbone_keeps_its_bits_and_only_the_adapters_train():
    run = _run("lora_rank=4", "quantization=te_nvfp4")
    assert run.startup.trained_params == "adapters"
    assert "trains: the LoRA adapters alone (rank 4" in run.startup.lines()[-1]
    state = run.init_state(seed=0)
    before = jax.device_get(state.params)
    # The optimizer keeps Adam moments for the adapters alone.
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
    assert {k.replace("['lora_a']", "").replace("['lora_b']", "") for k in _adapter_leaves(adam.mu)} and \
        len(jax.tree.leaves(adam.mu)) == len(_adapter_leaves(before)) == 2 * 7
    for _ in range(3):
        state, _ = run.train_step(state, run.put(BATCH))
    after = jax.device_get(state.params)
    backbone_before, adapters_before = lora.split(before)
    backbone_after, adapters_after = lora.split(after)
    for x, y in zip(jax.tree.leaves(backbone_before), jax.tree.leaves(backbone_after)):
        np.testing.assert_array_equal(x, y)
    assert all(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(adapters_before), jax.tree.leaves(adapters_after)))
    # With the backbone trained too (the feature off), its kernels move.
    full = _run("lora_rank=4", "quantization=te_nvfp4", "train_params=all")
    assert full.startup.trained_params == "all"
    s = full.init_state(seed=0)
    s, _ = full.train_step(s, full.put(BATCH))
    kernel = "layers", "mlp", "gate", "kernel"
    assert not np.array_equal(jax.device_get(s.params)["layers"]["mlp"]["gate"]["kernel"],
                              before["layers"]["mlp"]["gate"]["kernel"]), kernel


def test_grad_norm_is_the_adapters_gradient_norm():
    # fp32 and no quantization, so that the independent gradient is the step's up to summation order.
    run = _run("lora_rank=4", "dtype=float32", "base_num_decoder_layers=1")
    state = run.init_state(seed=0)
    state = state.replace(params=jax.tree_util.tree_map_with_path(  # B != 0: A gets a gradient too
        lambda p, v: v + 0.01 if jax.tree_util.keystr(p).endswith("['lora_b']") else v, state.params))
    full_grads = jax.jit(jax.grad(lambda p: _loss(run.model, p, state.fp8_meta, BATCH, state.sr_key())[0]))(state.params)
    adapter_grads = _adapter_leaves(full_grads)
    assert all(np.abs(g).max() > 0 for g in adapter_grads.values())
    want = math.sqrt(sum(float(np.sum(np.square(g.astype(np.float64)))) for g in adapter_grads.values()))
    _, metrics = run.train_step(state, run.put(BATCH))
    assert float(metrics["grad_norm"]) == pytest.approx(want, rel=1e-5)
    # The backbone's gradient is far from zero: it is left out, not small.
    backbone_norm = math.sqrt(sum(float(np.sum(np.square(np.asarray(g, np.float64))))
                                  for g in jax.tree.leaves(lora.split(full_grads)[0])))
    assert backbone_norm > want / 10


@pytest.mark.slow
def test_a_frozen_backbone_computes_no_weight_gradient_gemms():
    def dots(*extra):
        run = _run("lora_rank=4", "scan_layers=false", "quantization=te_nvfp4", *extra)
        hlo = run.train_step.lower(run.abstract_state, run.put(BATCH)).compile().as_text()
        return len(re.findall(r"= \S+ dot\(", hlo))

    frozen, trained = dots(), dots("train_params=all")
    # Every projection's weight-gradient GEMM of its frozen NVFP4 kernel is gone (7 per layer), and
    # the LM head's (measured: 141 dots against 120).
    assert trained - frozen >= 7 * 2 + 1, (trained, frozen)


@pytest.mark.slow
def test_a_backbone_checkpoint_loads_into_an_adapted_run_with_fresh_adapters(tmp_path):
    backbone_run = _run()
    params = jax.device_get(backbone_run.init_state(seed=3).params)
    out = str(tmp_path / "backbone")
    sums = {path: params_lib.write_leaf(out, path, np.asarray(leaf)) for path, leaf in params_lib._leaves(params)}
    params_lib.write_meta(out, backbone_run.cfg.model, "test", sums)
    adapted = _run("lora_rank=4")
    state = adapted.init_state(seed=0)
    fresh = _adapter_leaves(jax.device_get(state.params))
    loaded = jax.device_get(params_lib.load_into(out, state, adapted.state_shardings).params)
    backbone, adapters = lora.split(loaded)
    for (path, want), (_, got) in zip(params_lib._leaves(params), params_lib._leaves(backbone)):
        np.testing.assert_array_equal(got, want, err_msg=str(path))
    assert _adapter_leaves(loaded).keys() == fresh.keys()
    for key, value in _adapter_leaves(loaded).items():
        np.testing.assert_array_equal(value, fresh[key])


def test_merged_adapters_give_the_adapted_models_logits_without_adapters():
    run = _run("lora_rank=4", "dtype=float32")
    params = jax.device_get(run.init_state(seed=0).params)
    # Nonzero B so that merging has something to fold in.
    params = jax.tree_util.tree_map_with_path(
        lambda p, v: np.full(v.shape, 0.01, np.float32) if jax.tree_util.keystr(p).endswith("['lora_b']") else v, params)
    merged = lora.merged(params, lora.from_config(run.cfg.model))
    assert not _adapter_leaves(merged)
    plain = _run("dtype=float32")
    assert jax.tree.structure(merged) == jax.tree.structure(jax.device_get(plain.abstract_state.params))
    adapted_logits = run.model.apply({"params": params}, BATCH["inputs"])
    merged_logits = plain.model.apply({"params": merged}, BATCH["inputs"])
    assert float(jnp.abs(adapted_logits - plain.model.apply({"params": lora.split(params)[0]}, BATCH["inputs"])).max()) > 1e-3
    np.testing.assert_allclose(merged_logits, adapted_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("keys, message", [
    (["lora_rank=-1"], "lora_rank=-1 is not allowed: must be >= 0"),
    (["lora_rank=4", "lora_targets=query,mlp"], "lora_targets='query,mlp' is not allowed: a comma-separated list of"),
    (["lora_rank=4", "lora_alpha=0"], "lora_alpha=0.0 is not allowed: must be > 0"),
    (["train_params=adapters"], "train_params='adapters' is not allowed: 'adapters' needs lora_rank > 0"),
    (["train_params=some"], "train_params='some' is not allowed: choose one of ['auto', 'all', 'adapters']"),
])
def test_bad_adapter_keys_are_one_line_errors(keys, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY + keys)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


@pytest.mark.slow
def test_to_hf_of_an_adapted_run_exports_the_merged_kernels(tmp_path, capsys):
    from safetensors.numpy import load_file

    from nvfp4_jax.convert.checkpoints import to_hf
    from nvfp4_jax.train import checkpoint
    from nvfp4_jax.train.loop import run

    cfg = load_config(TINY + ["lora_rank=4", "quantization=te_nvfp4", "steps=2", "checkpoint_period=2",
                              "eval_interval=1000", f"base_output_directory={tmp_path}", "run_name=run"])
    run(cfg, progress=False, devices=ONE_DEVICE)
    parts = assembly.assemble(cfg, ONE_DEVICE)
    manager = checkpoint.make_manager(str(tmp_path / "run" / "checkpoints"), max_to_keep=3)
    params = jax.device_get(checkpoint.restore(manager, parts.abstract_state, 2)[0].params)
    manager.close()
    to_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert "note: merged the LoRA adapters (rank 4" in capsys.readouterr().err
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert not any("lora" in name for name in hf)
    down = params["layers"]["mlp"]["down"]
    want = down["kernel"][1].astype(np.float64) + 4.0 * down["lora_a"][1].astype(np.float64) @ down["lora_b"][1]
    assert np.abs(down["lora_b"][1]).max() > 0  # trained: the merge changes the kernel
    np.testing.assert_allclose(hf["model.layers.1.mlp.down_proj.weight"], want.T, rtol=1e-6, atol=1e-7)
