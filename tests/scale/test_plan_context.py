"""`plan` under context and tensor parallelism: memory, communication and the longest context."""

import re

import pytest

from nvfp4_jax import plan
from nvfp4_jax.cli import Exit
from nvfp4_jax.config import load_config

GIB = 1024**3
EIGHT_B = ["model_name=llama3-8b", "scan_layers=true", "remat_policy=full", "attention=cudnn_flash"]
D, N, V = 4096, 32, 128256


def _plan(*extra, devices=8, memory_gib=None):
    return plan.make_plan(load_config(EIGHT_B + list(extra)), devices,
                          None if memory_gib is None else memory_gib * GIB)


def test_context_shards_the_state_like_fsdp_and_divides_the_tokens():
    fsdp = _plan("ici_fsdp_parallelism=8", "max_target_length=8192", "per_device_batch_size=1")
    context = _plan("ici_fsdp_parallelism=1", "ici_context_parallelism=8", "max_target_length=65536",
                    "per_device_batch_size=0.125")
    # Parameters shard their embed axis over fsdp x context: the same state per device.
    assert context.parameter_bytes_per_device == fsdp.parameter_bytes_per_device
    assert context.optimizer_bytes_per_device == fsdp.optimizer_bytes_per_device
    # One 64K sequence over 8 devices is 8K tokens each, like one 8K sequence per device:
    # full remat saves each layer's input, N * T * D bf16 values.
    assert context.saved_activation_bytes_per_device == fsdp.saved_activation_bytes_per_device == N * 8192 * D * 2
    assert context.global_batch_size == 1 and context.context == 8


def test_tensor_parallelism_divides_the_head_and_mlp_shards():
    m = load_config(EIGHT_B + ["max_target_length=8192", "remat_policy=none"]).model
    t1 = plan.activation_bytes(m, 1, "cudnn_flash", tensor=1)
    t4 = plan.activation_bytes(m, 1, "cudnn_flash", tensor=4)
    HK, GK, F = 32 * 128, 8 * 128, 14336
    per_token = lambda t: (4 * D + (2 * GK + HK + 3 * F) / t) * 2 + 4 * 32 / t  # noqa: E731
    # Saved (no remat): every D-sized activation whole, the heads' and MLP's split 4 ways; the
    # quantized dots keep nothing here (bf16).
    assert t1[0] == pytest.approx(N * 8192 * per_token(1))
    assert t4[0] == pytest.approx(N * 8192 * per_token(4))


@pytest.mark.parametrize("c", [2, 4, 8])
def test_ulysses_moves_a_shrinking_share_of_ring_attentions_bytes(c):
    # MHA (H = G): ring sends 3 (c-1) T 2GK a, Ulysses 2 (c-1)/c T 4HK a, so ring / ulysses = 0.75 c.
    cfg = load_config(["model_name=tiny", "base_num_query_heads=8", "base_num_kv_heads=8",
                       f"max_target_length={64 * c}"])
    comm = plan.communication_bytes(cfg.model, 1, c, 1)
    T, K, a = 64, 32, 2
    assert comm.ulysses == pytest.approx(2 * (c - 1) / c * T * 4 * 8 * K * a)
    assert comm.ring / comm.ulysses == pytest.approx(0.75 * c)
    assert comm.all_gather == pytest.approx(2 * (c - 1) * T * 2 * 8 * K * a)


def test_ulysses_counts_the_repeated_kv_heads():
    cfg = load_config(["model_name=tiny", "base_num_query_heads=8", "base_num_kv_heads=2", "max_target_length=512"])
    comm = plan.communication_bytes(cfg.model, 1, 8, 1)
    # 2 KV heads are repeated to 8 so that each of 8 devices gets one: q, k, v, out all 8 heads.
    assert comm.ulysses == pytest.approx(2 * 7 / 8 * 64 * (2 * 8 + 2 * 8) * 32 * 2)


def test_max_context_is_the_longest_length_that_fits():
    cfg = load_config(EIGHT_B + ["ici_fsdp_parallelism=1", "ici_context_parallelism=8",
                                 "per_device_batch_size=0.125", "num_vocab_tiling=16"])
    length, best = plan.max_context(cfg, 8, 80 * GIB)
    # BF16 needs L divisible by context=8 and num_vocab_tiling=16: a step of 16 tokens.
    assert best is not None and best.fits and length % 16 == 0 and length > 100_000
    longer = load_config(EIGHT_B + ["ici_fsdp_parallelism=1", "ici_context_parallelism=8",
                                    "per_device_batch_size=0.125", "num_vocab_tiling=16",
                                    f"max_target_length={length + 16}"])
    assert not plan.make_plan(longer, 8, 80 * GIB).fits


def test_llama3_8b_at_a_million_tokens_on_eight_devices_is_planned(capsys):
    # One 1,048,576-token sequence over ici_context_parallelism=8, full remat, fused attention.
    argv = EIGHT_B + ["ici_fsdp_parallelism=1", "ici_context_parallelism=8", "per_device_batch_size=0.125",
                      "max_target_length=1048576", "num_vocab_tiling=256", "context_parallel_strategy=ulysses",
                      "--num-devices", "8", "--device-memory-gib", "141"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "mesh: data=1 x fsdp=1 x context=8 x tensor=1 (8 devices)" in out
    # 131,072 tokens per device; full remat keeps 32 layers x 131072 x 4096 bf16 = 32 GiB.
    assert re.search(r"saved activations:\s+32\.00 GiB", out)
    assert "fits: yes" in out and "context (ulysses):" in out
    # Without the vocabulary tiling the fp32 logits alone (131072 x 128256 x 8 bytes) sink it.
    assert plan.main([a for a in argv if not a.startswith("num_vocab_tiling")]) == Exit.DOES_NOT_FIT
    assert "fits: NO" in capsys.readouterr().out


def test_max_context_flag_prints_the_length_and_needs_a_memory_size(capsys):
    argv = EIGHT_B + ["ici_fsdp_parallelism=1", "ici_context_parallelism=8", "per_device_batch_size=0.125",
                      "num_vocab_tiling=16", "--num-devices", "8"]
    assert plan.main(argv + ["--max-context"]) == 2
    assert "--max-context needs the device's memory" in capsys.readouterr().err
    plan.main(argv + ["--max-context", "--device-memory-gib", "80"])
    length = int(re.search(r"max context: max_target_length=([\d,]+) fits", capsys.readouterr().out)
                 .group(1).replace(",", ""))
    assert length == plan.max_context(load_config(EIGHT_B + argv[4:8]), 8, 80 * GIB)[0]
