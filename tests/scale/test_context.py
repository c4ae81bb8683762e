"""Context (sequence) and tensor parallelism: Ulysses and all_gather attention, and whole train
steps on context x tensor x fsdp meshes, each against one device / fsdp=8 on the same batch."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from tolerance import DIVISION_ROUNDINGS, U, assert_within, attention_error_bounds, error_statistic_rtol, gamma

from nvfp4_jax import sharding
from nvfp4_jax.config import ConfigError, MeshConfig, load_config
from nvfp4_jax.model.attention import attention_fn, causal_attention
from nvfp4_jax.model.ulysses import all_gather_attention, kv_repeats, ulysses_attention
from nvfp4_jax.quant import nvfp4_gemm_operand, quantize_nvfp4

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MESHES = {
    "context8": MeshConfig(ici_fsdp_parallelism=1, ici_context_parallelism=8),
    "context4xfsdp2": MeshConfig(ici_fsdp_parallelism=2, ici_context_parallelism=4),
    "context2xtensor2xfsdp2": MeshConfig(ici_fsdp_parallelism=2, ici_context_parallelism=2,
                                         ici_tensor_parallelism=2),
}


def _qkv(B, L, H, G, K, seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(kq, (B, L, H, K)), jax.random.normal(kk, (B, L, G, K)),
            jax.random.normal(kv, (B, L, G, K)))


def _weights(shape):
    """The loss's weight of each output element: i / size, exact in fp32 (size a power of 2)."""
    size = int(np.prod(shape))
    assert size & (size - 1) == 0
    return (np.arange(size, dtype=np.float64) / size).reshape(shape)


def _value_and_grads(attend):
    # A loss that weighs every output element differently, so a permuted head or position shows.
    def loss(q, k, v):
        out = attend(q, k, v)
        return (out * jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape) / out.size).sum()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _exact_loss_and_grads(q, k, v, key_blocks=1):
    """The exact (float64) loss and dQ/dK/dV of `_value_and_grads`, each with the fp32 rounding
    bound of one evaluation (tests/tolerance.py): the attention's, through the weighted sum
    (its products and out.size - 1 additions: gamma(out.size) of sum |c out|)."""
    c = _weights(q.shape)
    b = attention_error_bounds(q, k, v, c, key_blocks=key_blocks)
    out, out_err = b["out"]
    loss = (float((c * out).sum()), float((c * out_err).sum() + gamma(out.size) * np.abs(c * out).sum()))
    return loss, [b[name] for name in ("dq", "dk", "dv")]


def _assert_single_device_attention(mesh_name, attend, B, H, G, key_blocks=1):
    """`attend(q, k, v)` on the sharded mesh against dot_product on one device: value and dQ/dK/dV."""
    mesh = sharding.make_mesh(MESHES[mesh_name])
    q, k, v = _qkv(B, 64, H, G, 16)
    ref = _value_and_grads(causal_attention)(q, k, v)
    spec = NamedSharding(mesh, P(sharding.BATCH_AXES, "context", "tensor", None))
    q_s, k_s, v_s = (jax.device_put(x, spec) for x in (q, k, v))
    with sharding.activation_sharding(mesh):
        got = _value_and_grads(attend)(q_s, k_s, v_s)
    # Same per-head arithmetic on every device; fp32 sums may run in another order: each within
    # its fp32 bound of the exact value (`key_blocks`: an online softmax's rescalings).
    (loss, one_bound), grads = _exact_loss_and_grads(q, k, v)
    (_, sharded_bound), grads_sharded = _exact_loss_and_grads(q, k, v, key_blocks)
    assert_within(float(ref[0]), loss, one_bound, "one device loss")
    assert_within(float(got[0]), loss, sharded_bound, "sharded loss")
    for name, g_ref, g_got, (want, bound), (_, bound_sharded) in zip(("dQ", "dK", "dV"), ref[1], got[1], grads, grads_sharded):
        assert_within(g_ref, want, bound, f"one device {name}")
        assert_within(g_got, want, bound_sharded, f"sharded {name}")


@pytest.mark.parametrize("wrapper, mesh_name, H, G", [
    (ulysses_attention, "context8", 8, 2),  # GQA, 2 KV heads repeated to 8
    (ulysses_attention, "context8", 8, 1),  # MQA, 1 KV head repeated to 8
    (ulysses_attention, "context4xfsdp2", 8, 8),
    (ulysses_attention, "context4xfsdp2", 8, 4),  # GQA, KV heads split, no repeat
    (ulysses_attention, "context2xtensor2xfsdp2", 8, 2),  # 1 KV head per tensor shard, repeated
    (all_gather_attention, "context4xfsdp2", 8, 2),
    (all_gather_attention, "context2xtensor2xfsdp2", 8, 2),
], ids=lambda p: getattr(p, "__name__", str(p)))
def test_context_parallel_attention_is_single_device_attention(wrapper, mesh_name, H, G):
    _assert_single_device_attention(mesh_name, lambda q, k, v: wrapper(causal_attention, q, k, v), 4, H, G)


def test_ulysses_around_the_chunked_kernel_is_single_device_attention():
    # The chunked kernel's loops run inside Ulysses' shard_map (their carries must be typed like
    # the sharded blocks).
    chunked = attention_fn("chunked", 16)
    _assert_single_device_attention("context4xfsdp2", lambda q, k, v: ulysses_attention(chunked, q, k, v), 2, 8, 2,
                                    key_blocks=64 // 16)


def test_ulysses_passes_whole_sequence_segment_ids_to_the_kernel():
    mesh = sharding.make_mesh(MESHES["context4xfsdp2"])
    q, k, v = _qkv(2, 64, 4, 2, 16)
    segments_BxL = jnp.asarray(np.repeat(np.arange(1, 5), 16)[None].repeat(2, 0), jnp.int32)

    def kernel(q, k, v, *, segment_ids_BxL):
        # Stand-in for a segment-aware kernel: tags the output with the segment id it saw.
        assert segment_ids_BxL.shape == q.shape[:2]
        return causal_attention(q, k, v) + segment_ids_BxL[:, :, None, None].astype(q.dtype)

    with sharding.activation_sharding(mesh):
        got = jax.jit(lambda *a: ulysses_attention(kernel, *a[:3], segment_ids_BxL=a[3]))(q, k, v, segments_BxL)
    want = causal_attention(q, k, v) + segments_BxL[:, :, None, None]
    # Both: an fp32 attention (within its bound of the exact one) plus a small integer, rounded.
    out, out_err = attention_error_bounds(q, k, v)["out"]
    exact = out + np.asarray(segments_BxL)[:, :, None, None]
    bound = out_err + U * (np.abs(exact) + out_err)
    assert_within(got, exact, bound, "ulysses")
    assert_within(want, exact, bound, "one device")


@pytest.mark.parametrize("H, G, ways", [(8, 8, 4), (8, 2, 4), (8, 1, 8), (12, 4, 6), (4, 2, 4)])
def test_repeated_kv_heads_keep_each_query_head_with_its_group(H, G, ways):
    r = kv_repeats(G, H, ways)
    G2 = G * r
    assert G2 % ways == 0 and H % G2 == 0
    # Query head h meets repeated head h // (H / G2), which is the copy of KV head (that) // r:
    # the original grouping h // (H / G). The all-to-all hands device j heads [j H/ways, ...)
    # and repeated KV heads [j G2/ways, ...), the same groups.
    for h in range(H):
        assert (h // (H // G2)) // r == h // (H // G)
        device = h // (H // ways)
        assert (h // (H // G2)) // (G2 // ways) == device


def _collectives(hlo: str, op: str) -> list[list[tuple[int, ...]]]:
    """Operand shapes of every `op` in compiled HLO text (XLA:CPU splits an all-to-all into a tuple)."""
    return [[tuple(int(d) for d in dims.split(",") if d) for _, dims in re.findall(r"(\w+)\[([0-9,]*)\]", result)]
            for result in re.findall(rf"= (\(.*?\)|\w+\[[0-9,]*\]\S*) {op}\(", hlo)]


def test_ulysses_exchanges_by_all_to_all_and_never_gathers_the_sequence():
    mesh = sharding.make_mesh(MESHES["context8"])
    B, L, H, G, K = 2, 128, 8, 2, 16
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P(sharding.BATCH_AXES, "context")))
               for s in ((B, L, H, K), (B, L, G, K), (B, L, G, K)))
    with sharding.activation_sharding(mesh):
        hlo = _value_and_grads(lambda q, k, v: ulysses_attention(causal_attention, q, k, v)).lower(
            q, k, v).compile().as_text()
    exchanged = _collectives(hlo, "all-to-all")
    # Forward: q, k, v (KV repeated to 8 heads) in, the output back; backward: the same four.
    assert len(exchanged) >= 4, exchanged
    # Each exchange moves this device's [B, L/8, H, K] shard, whatever pieces XLA cuts it into.
    assert all(sum(np.prod(s) for s in shapes) == B * (L // 8) * H * K for shapes in exchanged), exchanged
    gathered = [s for shapes in _collectives(hlo, "all-gather") for s in shapes]
    assert not any(len(s) >= 2 and L in s for s in gathered), gathered


def test_quantizer_under_sequence_and_tensor_sharding_is_bitwise_the_unsharded_one():
    mesh = sharding.make_mesh(MESHES["context2xtensor2xfsdp2"])
    x = jax.random.normal(jax.random.PRNGKey(0), (128, 256), jnp.float32).at[-1, -1].set(300.0)
    tokens = P((*sharding.BATCH_AXES, "context"), None)  # an activation's [B*L, D]: tokens over context
    columns = P("fsdp", "tensor")  # a weight's [D, F]: F over tensor
    # Tokens blocked along D (X for FPROP), along tokens after the RHT (X for WGRAD), 16x16 tiles.
    for spec, kwargs in ((tokens, dict()), (tokens, dict(axis=0, rht=True)), (columns, dict(two_d=True))):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        quantize = jax.jit(lambda a: quantize_nvfp4(a, **kwargs))
        ref, got = quantize(x), quantize(xs)
        np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(ref.codes))
        np.testing.assert_array_equal(np.asarray(got.scales).view(np.uint8), np.asarray(ref.scales).view(np.uint8))
        assert float(got.amax) == float(ref.amax)
    operand = jax.jit(lambda a: nvfp4_gemm_operand(a, stochastic=True, key=jax.random.PRNGKey(3)))
    (v_ref, s_ref), (v_got, s_got) = operand(x), operand(jax.device_put(x, NamedSharding(mesh, tokens)))
    np.testing.assert_array_equal(np.asarray(v_got, np.float32), np.asarray(v_ref, np.float32))
    assert float(s_got) == float(s_ref)


def _cfg(*extra):
    return load_config(["model_name=tiny", "base_num_decoder_layers=1", "max_target_length=64",
                        "base_num_query_heads=8", "base_num_kv_heads=2", "head_dim=16", *extra])


@pytest.mark.parametrize("extra, pattern", [
    (["ici_fsdp_parallelism=1", "ici_context_parallelism=8", "base_num_query_heads=4",
      "context_parallel_strategy=ulysses"],
     r"context_parallel_strategy=ulysses needs base_num_query_heads=4 .* divisible by the context parallelism 8"),
    (["ici_fsdp_parallelism=1", "ici_context_parallelism=8", "quantization=te_nvfp4", "max_target_length=64"],
     r"max_target_length=64 / context parallelism 8 = 8 tokens per shard, not a multiple of 16"),
    (["ici_fsdp_parallelism=1", "ici_context_parallelism=8", "max_target_length=100"],
     r"max_target_length=100 is not divisible by the context parallelism \(8\)"),
    (["ici_fsdp_parallelism=8", "per_device_batch_size=0.125"],
     r"global batch of 1 sequences, which data x fsdp = 1 x 8 devices cannot split evenly"),
    (["ici_fsdp_parallelism=1", "ici_context_parallelism=8", "per_device_batch_size=0.1"],
     r"per_device_batch_size=0.1 x 8 devices = 0.8 sequences: the global batch must be a whole number"),
    (["ici_fsdp_parallelism=2", "ici_tensor_parallelism=4"],
     r"base_num_kv_heads=2 must both be divisible by ici_tensor_parallelism=4"),
    (["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "quantization=te_nvfp4", "base_mlp_dim=400"],
     r"base_mlp_dim=400 / ici_tensor_parallelism=2 = 200 per shard, not a multiple of 16.*weight tiles"),
    (["ici_fsdp_parallelism=4", "ici_context_parallelism=2", "quantization_backend=te"],
     r"quantization_backend=te with ici_context_parallelism x ici_tensor_parallelism = 2 x 1"),
])
def test_bad_context_and_tensor_configurations_are_clear_errors(extra, pattern):
    cfg = _cfg(*extra)
    with pytest.raises(ConfigError, match=pattern):
        sharding.check_divisibility(cfg, sharding.make_mesh(cfg.mesh))


def test_fractional_batch_shares_one_sequence_over_the_context_axis():
    cfg = _cfg("ici_fsdp_parallelism=1", "ici_context_parallelism=8", "per_device_batch_size=0.125")
    mesh = sharding.make_mesh(cfg.mesh)
    sharding.check_divisibility(cfg, mesh)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "context": 8, "tensor": 1}
    assert sharding.global_batch_size(0.125, 8) == 1
    tokens = jax.device_put(np.zeros((1, 64), np.int32), sharding.batch_sharding(mesh))
    assert {s.data.shape for s in tokens.addressable_shards} == {(1, 8)}


def test_bad_mesh_is_one_line_error_from_the_cli():
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run(
        [sys.executable, "-m", "nvfp4_jax.train", "ici_fsdp_parallelism=1", "ici_context_parallelism=8",
         "context_parallel_strategy=ulysses", "dataset_type=synthetic"],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "base_num_query_heads=4" in lines[0], out.stderr


# --- whole train steps: every mesh against fsdp=8 on the same global batch --------------------

def _train_losses(extra, steps, *, stats=False):
    from nvfp4_jax.train import assembly

    run = assembly.assemble(_cfg("learning_rate=1e-2", "warmup_steps_fraction=0", "per_device_batch_size=1", *extra))
    assert run.global_batch == 8
    state, train = run.init_state(seed=0), run.dataset("train")
    batches = [run.put(train.batch(i)) for i in range(steps)]
    health = None
    if stats:
        from nvfp4_jax.quant import health as health_lib
        health = health_lib.flatten(run.quant_stats_step(state, batches[0]))
    losses = []
    for batch in batches:
        state, metrics = run.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, health


FP32_MESHES = {
    "context4xfsdp2_all_gather": ["ici_fsdp_parallelism=2", "ici_context_parallelism=4"],
    "context4xfsdp2_ulysses": ["ici_fsdp_parallelism=2", "ici_context_parallelism=4",
                               "context_parallel_strategy=ulysses"],
    "tensor2xfsdp4": ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
    "context2xtensor2xfsdp2_ulysses": ["ici_fsdp_parallelism=2", "ici_context_parallelism=2",
                                       "ici_tensor_parallelism=2", "context_parallel_strategy=ulysses"],
}


# Five fp32 train steps on another mesh: a trajectory (forward, backward, cross-device sums,
# Adam) has no practical a-priori bound. The meshes' losses differ from fsdp=8's by at most
# 5e-7 relative (measured); 1e-4 is 200x that, and 10x below a loss step of this run (~1e-2 a
# step at lr 1e-2), which a wrong cross-device sum or a lost shard of attention changes.
TRAJECTORY_RTOL = 1e-4


@pytest.mark.slow
def test_fp32_train_steps_on_context_and_tensor_meshes_match_fsdp8():
    ref, _ = _train_losses(["dtype=float32", "ici_fsdp_parallelism=8"], 5)
    for name, extra in FP32_MESHES.items():
        got, _ = _train_losses(["dtype=float32", *extra], 5)
        np.testing.assert_allclose(got, ref, rtol=TRAJECTORY_RTOL, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["context4xfsdp2_ulysses", "tensor2xfsdp4"])
def test_nvfp4_quantizes_every_operand_like_fsdp8(name):
    extra = ["dtype=float32", "quantization=te_nvfp4"]
    (ref, ref_stats) = _train_losses(extra + ["ici_fsdp_parallelism=8"], 2, stats=True)
    (got, got_stats) = _train_losses(extra + FP32_MESHES[name], 2, stats=True)
    assert set(got_stats) == set(ref_stats) and ref_stats
    # Context parallelism splits no forward contraction: every operand is bitwise fsdp=8's.
    # Tensor parallelism's row-parallel projections (out, down) add partial sums across shards,
    # so what flows from them (the next layers' inputs, every dY) differs by fp32 rounding
    # order: those operands' statistics agree within it, not bit for bit (known limitation).
    exact = "tensor" not in name
    model = _cfg().model
    tokens = 8 * 64  # the global batch
    largest = max(tokens * model.base_emb_dim, tokens * model.base_mlp_dim, model.base_emb_dim * model.base_mlp_dim)
    for projection, operands in ref_stats.items():
        for operand, stats in operands.items():
            for stat, value in stats.items():
                got_value = got_stats[projection][operand][stat]
                if exact or operand.startswith("w"):  # weights: the same fp32 parameters at step 1
                    if stat == "error":  # a sum of squares: fp32 reduction order, two evaluations
                        rtol = 2 * error_statistic_rtol(largest)
                        assert got_value == pytest.approx(value, rel=rtol, abs=0), (projection, operand)
                    else:  # the global amax and counts of blocks/values: exact when the codes are
                        assert got_value == value, (projection, operand, stat)
                else:
                    # Operands that differ by fp32 rounding may round to other E2M1 codes (and
                    # amax by an ulp): quantization-sized, far above fp32 noise.
                    assert got_value == pytest.approx(value, rel=1e-4, abs=1e-3), (projection, operand, stat)
    if exact:
        # The same per-token losses (every operand bitwise fsdp=8's), their mean taken in another
        # order: two evaluations of a 512-token sum of positive terms and one division.
        first_rtol = 2 * gamma(tokens + DIVISION_ROUNDINGS)
    else:
        # Forward partial sums differ too: a 1-layer model's fp32 noise, measured at 8e-8 of the
        # loss; 1e-4 is 1000x that and well below FP4 quantization-sized changes.
        first_rtol = 1e-4
    np.testing.assert_allclose(got[0], ref[0], rtol=first_rtol)
    # Later steps start from gradients summed across devices in another order, which FP4
    # rounding amplifies (codes flip): quantization-sized, far above fp32 noise.
    np.testing.assert_allclose(got, ref, rtol=5e-3)


@pytest.mark.slow
def test_the_readme_16k_context_parallel_command_trains(tmp_path):
    """The 16K context-parallel command of docs/scaling.md (the README's "Scale out" points
    there), as written there (2 steps of one 16K sequence on 8 devices), with its run directory
    moved under tmp_path."""
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)
    command = next(b for b in blocks if "ici_context_parallelism=8 per_device_batch_size=0.125" in b
                   and "nvfp4_jax.train" in b)
    words = command.replace("\\\n", " ").split()
    env_words = [w for w in words if w.startswith("XLA_FLAGS=")]
    argv = [w for w in words[words.index("nvfp4_jax.train") + 1:]]
    env = dict(os.environ, PYTHONPATH=ROOT, **dict(w.split("=", 1) for w in env_words))
    out = subprocess.run([sys.executable, "-m", "nvfp4_jax.train", *argv, f"base_output_directory={tmp_path}",
                          "run_name=readme16k"], capture_output=True, text=True, env=env, timeout=1500, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(os.path.join(tmp_path, "readme16k", "metrics.jsonl")) as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
    # One sequence of 16384 tokens is the whole global batch.
    assert "max_target_length=16384" in command


@pytest.mark.slow
def test_a_ulysses_train_step_exchanges_by_all_to_all_and_never_gathers_full_sequence_activations():
    from nvfp4_jax.train import assembly

    cfg = _cfg("ici_fsdp_parallelism=1", "ici_context_parallelism=8", "per_device_batch_size=0.125",
               "max_target_length=256", "context_parallel_strategy=ulysses", "quantization=te_nvfp4")
    run = assembly.assemble(cfg)  # all 8 devices
    state = run.init_state(seed=0)
    tokens = jax.device_put(jnp.zeros((1, 256), jnp.int32), run.batch_sharding)
    hlo = run.train_step.lower(state, {"inputs": tokens, "targets": tokens}).compile().as_text()
    exchanged = [shapes for shapes in _collectives(hlo, "all-to-all")
                 if all(len(s) == 4 and s[1] == 256 // 8 and s[-1] == 16 for s in shapes)]
    assert len(exchanged) >= 8, exchanged  # q, k, v, out forward; their gradients backward
    # Activations stay sequence-split: no floating-point all-gather brings back a [.., L, ..]
    # array of 3 or more dimensions (weights are 2-D; the token ids are int32).
    gathered = [s for shapes in _collectives(hlo, "all-gather") for s in shapes]
    assert not any(len(s) >= 3 and 256 in s for s in gathered), gathered
