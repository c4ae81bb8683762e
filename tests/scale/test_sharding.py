"""Sharded runs quantize and train exactly like single-device runs (8 virtual CPU devices)."""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from tolerance import DIVISION_ROUNDINGS, gamma

from nvfp4_jax import sharding
from nvfp4_jax.config import ConfigError, MeshConfig, load_config
from nvfp4_jax.quant import nvfp4_gemm_operand, quantize_nvfp4

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


@pytest.mark.parametrize(
    "mesh_cfg, expected",
    [
        (MeshConfig(ici_fsdp_parallelism=-1), (1, 8, 1, 1)),
        (MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=-1), (2, 4, 1, 1)),
        (MeshConfig(ici_data_parallelism=-1, ici_fsdp_parallelism=2), (4, 2, 1, 1)),
        (MeshConfig(dcn_data_parallelism=2, ici_data_parallelism=2, ici_fsdp_parallelism=2), (4, 2, 1, 1)),
        (MeshConfig(ici_fsdp_parallelism=2, ici_context_parallelism=-1), (1, 2, 4, 1)),
        (MeshConfig(ici_fsdp_parallelism=-1, dcn_context_parallelism=2, ici_tensor_parallelism=2), (1, 2, 2, 2)),
    ],
)
def test_mesh_shape_fills_in_minus_one(mesh_cfg, expected):
    assert sharding.mesh_shape(mesh_cfg, 8) == expected
    assert sharding.make_mesh(mesh_cfg).devices.shape == expected


@pytest.mark.parametrize(
    "mesh_cfg, pattern",
    [
        (MeshConfig(ici_data_parallelism=3, ici_fsdp_parallelism=2), r"ici_data_parallelism \* ici_fsdp_parallelism = 3 \* 2 = 6, but there are 8 devices"),
        (MeshConfig(ici_data_parallelism=3, ici_fsdp_parallelism=-1), r"multiply to 3.*8 devices"),
        (MeshConfig(ici_data_parallelism=-1, ici_fsdp_parallelism=-1), r"At most one mesh axis may be -1"),
    ],
)
def test_bad_mesh_is_a_clear_error(mesh_cfg, pattern):
    with pytest.raises(ConfigError, match=pattern):
        sharding.mesh_shape(mesh_cfg, 8)


def test_indivisible_embedding_is_a_clear_error():
    cfg = load_config(["base_emb_dim=100", "ici_fsdp_parallelism=8"])
    with pytest.raises(ConfigError, match=r"base_emb_dim=100 is not divisible by the fsdp mesh axis \(8\)"):
        sharding.check_divisibility(cfg, sharding.make_mesh(cfg.mesh))


def _x(shape, seed=0):
    x = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)
    # One outlier in a corner that only one shard holds: a per-shard amax would differ.
    return x.at[-1, -1].set(300.0)


@pytest.mark.parametrize("spec", [P("data", "fsdp"), P(("data", "fsdp"), None), P(None, ("data", "fsdp"))])
def test_sharded_quantize_is_bitwise_the_unsharded_one(spec):
    mesh = sharding.make_mesh(MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=4))
    x = _x((128, 256))
    x_sharded = jax.device_put(x, NamedSharding(mesh, spec))
    assert len(x_sharded.sharding.device_set) == 8
    for kwargs in (dict(), dict(two_d=True), dict(axis=0, rht=True)):
        quantize = jax.jit(lambda a: quantize_nvfp4(a, **kwargs))
        ref, got = quantize(x), quantize(x_sharded)
        np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(ref.codes))
        np.testing.assert_array_equal(np.asarray(got.scales).view(np.uint8), np.asarray(ref.scales).view(np.uint8))
        assert float(got.amax) == float(ref.amax)
        if not kwargs.get("rht"):
            assert float(ref.amax) == 300.0  # the global outlier, not a shard's own max
    key = jax.random.PRNGKey(3)
    operand = jax.jit(lambda a: nvfp4_gemm_operand(a, stochastic=True, key=key))
    (v_ref, s_ref), (v_got, s_got) = operand(x), operand(x_sharded)
    np.testing.assert_array_equal(np.asarray(v_got, np.float32), np.asarray(v_ref, np.float32))
    assert float(s_got) == float(s_ref)


# The mean loss of one step over a global batch of 8 x 64 tokens, on two meshes that compute
# every token's loss alike and only sum them in another order (per device, then across
# devices): two fp32 evaluations of a 512-term sum of positive terms and one division each.
SAME_TOKENS_RTOL = 2 * gamma(8 * 64 + DIVISION_ROUNDINGS)  # 6e-5; measured: 8e-8

TINY = ["model_name=tiny", "base_num_decoder_layers=2", "max_target_length=64", "log_period=1",
        "eval_steps=1", "eval_interval=1000", "enable_checkpointing=false", "quantization=te_nvfp4",
        "steps=3", "learning_rate=1e-2", "dtype=float32"]


@pytest.mark.slow
def test_loss_trajectory_is_the_same_on_1_2x4_and_8_devices(tmp_path):
    from nvfp4_jax.train.loop import run

    trajectories = {}
    # Same global batch (8 sequences) on every mesh.
    for name, devices, extra in [
        ("1", jax.devices()[:1], ["per_device_batch_size=8", "ici_fsdp_parallelism=1"]),
        ("2x4", jax.devices(), ["per_device_batch_size=1", "ici_data_parallelism=2", "ici_fsdp_parallelism=4"]),
        ("8", jax.devices(), ["per_device_batch_size=1", "ici_fsdp_parallelism=8"]),
    ]:
        cfg = load_config(TINY + extra + [f"base_output_directory={tmp_path}", f"run_name=m{name}"])
        run(cfg, progress=False, devices=devices)
        with open(os.path.join(tmp_path, f"m{name}", "metrics.jsonl")) as f:
            import json
            trajectories[name] = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    first = trajectories["1"]
    for name in ("2x4", "8"):
        assert len(trajectories[name]) == 3
        # Step 1: identical parameters and data, and every quantizer sees the global amax
        # (test_sharded_quantize_is_bitwise_the_unsharded_one); the loss still sums its tokens in
        # another order (per device, then across devices): the bound of that sum.
        np.testing.assert_allclose(trajectories[name][0], first[0], rtol=SAME_TOKENS_RTOL, err_msg=name)
        # Later steps start from gradients summed across devices in another order (fp32); FP4
        # rounding amplifies those last-bit differences (E2M1 codes flip): quantization-sized
        # differences (measured up to 7e-4), far above fp32 noise.
        np.testing.assert_allclose(trajectories[name][1:], first[1:], rtol=5e-3, err_msg=name)


@pytest.mark.slow
def test_a_trained_checkpoint_restores_onto_another_mesh_and_trains_on_like_unsharded(tmp_path):
    from nvfp4_jax import data as data_lib
    from nvfp4_jax.train import assembly, checkpoint

    cfg = load_config(["model_name=tiny", "base_num_decoder_layers=1", "max_target_length=64", "dtype=float32",
                       "quantization=te_fp8_delayedscaling", "learning_rate=1e-2", "warmup_steps_fraction=0",
                       "scan_layers=true"])
    train = data_lib.make_dataset(cfg.data, seq_len=64, global_batch_size=8, seed=0, split="train", vocab_size=256)

    def train_steps(parts, state, steps):
        losses = []
        for i in steps:
            state, metrics = parts.train_step(state, parts.put(train.batch(i)))
            losses.append(float(metrics["loss"]))
        return state, losses

    fsdp8 = assembly.assemble(cfg, mesh_config=MeshConfig(ici_fsdp_parallelism=8))
    state, _ = train_steps(fsdp8, fsdp8.init_state(seed=0), [0, 1])
    # A trained state, not an initial one: a step count, moments and amax histories all moved.
    kernel = state.params["layers"]["mlp"]["gate"]["kernel"]  # [layers, D, F], D over fsdp (x context)
    assert int(state.step) == 2 and len(kernel.sharding.device_set) == 8
    assert tuple(kernel.sharding.spec)[:2] == (None, ("fsdp", "context"))  # embed over fsdp x context (size 1 here)
    adam = state.opt_state[1][0]
    assert all(float(jnp.abs(m).max()) > 0 for m in jax.tree.leaves((adam.mu, adam.nu)))
    histories = [l for p, l in jax.tree_util.tree_flatten_with_path(state.fp8_meta)[0] if "history" in jax.tree_util.keystr(p)]
    assert histories and all(float(jnp.abs(h).max()) > 0 for h in histories)
    manager = checkpoint.make_manager(str(tmp_path), max_to_keep=1)
    checkpoint.save(manager, state, {"step": 2})
    saved = [np.asarray(leaf) for leaf in jax.tree.leaves(state)]

    continued = {}
    for name, parts in [("2x4", assembly.assemble(cfg, mesh_config=MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=4))),
                        ("1", assembly.assemble(cfg, jax.devices()[:1], mesh_config=MeshConfig(ici_fsdp_parallelism=1)))]:
        mesh = parts.mesh
        restored, _, verified = checkpoint.restore(manager, parts.abstract_state)
        assert verified
        assert restored.params["layers"]["mlp"]["gate"]["kernel"].sharding.mesh.shape == dict(zip(sharding.MESH_AXES, mesh.devices.shape))
        for a, b in zip(saved, jax.tree.leaves(restored)):
            np.testing.assert_array_equal(a, np.asarray(b))
        _, continued[name] = train_steps(parts, restored, [2, 3])
    # The first continued step starts from identical state bits on both meshes (fp32 compute),
    # its tokens' losses summed in another order; the second from updates summed across devices
    # in another order, which FP8 rounding amplifies: quantization-sized, far above fp32 noise.
    assert continued["2x4"][0] == pytest.approx(continued["1"][0], rel=SAME_TOKENS_RTOL)
    np.testing.assert_allclose(continued["2x4"], continued["1"], rtol=5e-3)


def _collectives(hlo: str, op: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(element type, operand shapes) of every `op` in compiled HLO text (tuple results too)."""
    found = []
    for result in re.findall(rf"= (\(.*?\)|\w+\[[0-9,]*\]\S*) {op}\(", hlo):
        shapes = re.findall(r"(\w+)\[([0-9,]*)\]", result)
        found.append((shapes[0][0], [tuple(int(d) for d in dims.split(",") if d) for _, dims in shapes]))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", ["true", "false"])
def test_fsdp_step_gathers_weights_and_never_the_embedding_table(scan_layers):
    from nvfp4_jax.train import assembly

    cfg = load_config(TINY[:3] + ["quantization=te_nvfp4", "ici_fsdp_parallelism=8",
                                  f"scan_layers={scan_layers}"])
    run = assembly.assemble(cfg)  # all 8 devices
    state = run.init_state(seed=0)
    tokens = jax.device_put(jnp.zeros((8, 64), jnp.int32), run.batch_sharding)
    hlo = run.train_step.lower(state, {"inputs": tokens, "targets": tokens}).compile().as_text()
    table = state.params["token_embedder"]["embedding"].shape
    weights = {p.shape for p in jax.tree.leaves(state.params)} - {table}
    # A scan gathers one layer's slice of a stacked [layers, ...] weight at a time.
    weights |= {p.shape[1:] for p in jax.tree.leaves(state.params.get("layers", {}))}
    gathered = [(dtype, shapes) for dtype, shapes in _collectives(hlo, "all-gather") if dtype in ("f32", "bf16")]
    assert gathered, "FSDP must all-gather the sharded weights"
    # Every floating-point all-gather rebuilds a weight other than the embedding table;
    # activations stay split over the batch.
    assert {shape for _, shapes in gathered for shape in shapes} <= weights, gathered
    # The lookup's rows move by all-to-all instead: this device's [B_group, L, D/8] rows in,
    # [B/8, L, D] out; once forward, once for the gradient, nothing else.
    per_device = 8 * 64 * cfg.model.base_emb_dim // 8
    exchanged = [sum(math.prod(s) for s in shapes) for _, shapes in _collectives(hlo, "all-to-all")]
    assert exchanged == [per_device, per_device], exchanged
