"""Analytic training FLOPs, checked by hand on a tiny shape."""

from nvfp4_jax.config import ModelConfig
from nvfp4_jax.flops import parameter_count, training_flops_per_step


def test_training_flops_by_hand():
    cfg = ModelConfig(vocab_size=10, base_emb_dim=4, base_num_query_heads=2, base_num_kv_heads=1,
                      head_dim=2, base_mlp_dim=8, base_num_decoder_layers=1)
    # T = 1 * 3 tokens. Forward matmuls: ffn 2*3*4*8*3 = 576, qkv 2*3*4*(2+2)*2 = 192,
    # out 2*3*2*2*4 = 96, lm_head 2*3*4*10 = 240; causal attention 4*3*3*2*2/2 = 72.
    assert training_flops_per_step(cfg, 1, 3) == 3 * (576 + 192 + 96 + 240) + 3 * 72 == 3528
    # The weight term is 6 x (params in matmuls) x tokens: all but the embedding and norms.
    matmul_params = parameter_count(cfg) - cfg.vocab_size * 4 - 3 * 4
    assert 6 * matmul_params * 3 + 3 * 72 == 3528
    # Twice the batch is twice the work; twice the sequence more than twice (attention).
    assert training_flops_per_step(cfg, 2, 3) == 2 * 3528
    assert training_flops_per_step(cfg, 1, 6) > 2 * 3528


def test_adapters_and_a_frozen_backbone_by_hand():
    cfg = ModelConfig(vocab_size=10, base_emb_dim=4, base_num_query_heads=2, base_num_kv_heads=1,
                      head_dim=2, base_mlp_dim=8, base_num_decoder_layers=1, lora_rank=2,
                      lora_targets="query,down")
    # Adapters: query [4, 4] and down [8, 4], rank 2: 2*(4+4) + 2*(8+4) = 40 parameters, and
    # 2 * 3 tokens * 40 = 240 forward FLOPs, trained (x3).
    plain = ModelConfig(vocab_size=10, base_emb_dim=4, base_num_query_heads=2, base_num_kv_heads=1,
                        head_dim=2, base_mlp_dim=8, base_num_decoder_layers=1)
    assert parameter_count(cfg) == parameter_count(plain) + 40
    assert training_flops_per_step(cfg, 1, 3) == 3528 + 3 * 240
    # A frozen backbone: no weight gradient of its kernels or LM head, x2 instead of x3.
    assert training_flops_per_step(cfg, 1, 3, frozen_backbone=True) == 2 * (576 + 192 + 96 + 240) + 3 * 72 + 3 * 240


def test_parameter_count_is_the_adapted_models():
    import jax

    from nvfp4_jax.config import load_config
    from nvfp4_jax.train import assembly

    cfg = load_config(["model_name=tiny", "base_num_decoder_layers=2", "lora_rank=4", "lora_targets=key,up"])
    params = assembly.assemble(cfg, jax.devices()[:1]).abstract_state.params
    assert parameter_count(cfg.model) == sum(leaf.size for leaf in jax.tree.leaves(params))
