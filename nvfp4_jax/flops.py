"""Analytic parameter and training-FLOP counts of nvfp4_jax.model.Llama, the way MaxText counts.

MaxText (`calculate_tflops_training_per_device` in `maxtext_utils.py`) counts model FLOPs, not
hardware FLOPs: a [m, k] x [k, n] matmul is 2*m*k*n, the backward pass is twice the forward
(so x3), norms, softmax, RoPE, the embedding lookup and rematerialisation are not counted, and the
causal mask halves the attention products. With T = global_batch_size * seq_len tokens,
D = base_emb_dim, F = base_mlp_dim, H/G query/key-value heads of dim K, V = vocab_size, and N
decoder layers:

    ffn       = 2 * T * D * F * 3              gate, up, down
    qkv       = 2 * T * D * (H + 2 * G) * K    query, key, value projections
    proj      = 2 * T * H * K * D              output projection
    attention = 4 * T * seq_len * H * K / 2    QK^T and PV, halved by causality
    lm_head   = 2 * T * D * V                  logits (the lookup itself is free)

    training FLOPs per step = 3 * ((ffn + qkv + proj) * N + lm_head) + 3 * attention * N

The first term is 6 x (matmul parameters) x tokens. Divide by the device count for MaxText's
per-device figure, and by step time for TFLOP/s/device.

LoRA adapters (`lora_rank` r > 0) add `2 * T * r * (k + n)` a forward pass for each targeted
[k, n] projection, trained (x3). A frozen backbone (`frozen_backbone=True`) computes no weight
gradient of its kernels and LM head: those GEMMs count x2 (forward and input gradient), not x3.

The VLM (`model_type=vlm`, model/vlm.py) adds its vision tower over Tv = global_batch_size * P
image tokens (P = num_patches, Q = patch_size^2 * image_channels pixels a patch, E =
vision_emb_dim, Fv = vision_mlp_dim, Nv = vision_num_layers), trained (x3); its attention is
bidirectional (not halved). The decoder's count above runs over the whole row (seq_len =
max_target_length, image tokens included):

    vision = 2 * Tv * Q * E + (2 * Tv * E * Fv * 3 + 2 * Tv * 4 * E^2 + 4 * Tv * P * E) * Nv
             + 2 * Tv * (E * D + D * D)    patch embedding, encoder layers, projector
"""

from __future__ import annotations

from nvfp4_jax.config import ModelConfig


def parameter_count(cfg: ModelConfig) -> int:
    """Exact number of parameters `Llama(cfg)` creates (untied embedding and LM head)."""
    D, F, K = cfg.base_emb_dim, cfg.base_mlp_dim, cfg.head_dim
    H, G = cfg.base_num_query_heads, cfg.base_num_kv_heads
    attention = D * H * K + 2 * D * G * K + H * K * D
    mlp = 3 * D * F
    norms = 2 * D
    adapters = sum(cfg.lora_rank * (k + n) for k, n in _adapted_shapes(cfg))
    decoder = cfg.base_num_decoder_layers * (attention + mlp + norms + adapters) + 2 * cfg.vocab_size * D + D
    return decoder + (_vision_parameters(cfg) if cfg.model_type == "vlm" else 0)


def _vision_parameters(cfg: ModelConfig) -> int:
    """The VLM's encoder and projector parameters (model/vision.py)."""
    E, Fv, D = cfg.vision_emb_dim, cfg.vision_mlp_dim, cfg.base_emb_dim
    Q = cfg.patch_size ** 2 * cfg.image_channels
    layer = 4 * E * E + 3 * E * Fv + 2 * E
    return Q * E + cfg.num_patches * E + cfg.vision_num_layers * layer + E + E * D + D * D


def _adapted_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """The [k, n] kernel shapes of one layer's projections that carry a LoRA adapter."""
    if not cfg.lora_rank:
        return []
    D, F, K = cfg.base_emb_dim, cfg.base_mlp_dim, cfg.head_dim
    H, G = cfg.base_num_query_heads, cfg.base_num_kv_heads
    shapes = {"query": (D, H * K), "key": (D, G * K), "value": (D, G * K), "out": (H * K, D),
              "gate": (D, F), "up": (D, F), "down": (F, D)}
    return [shapes[name.strip()] for name in cfg.lora_targets.split(",")]


def training_flops_per_step(cfg: ModelConfig, global_batch_size: int, seq_len: int, *,
                            frozen_backbone: bool = False) -> float:
    """Model FLOPs of one training step (forward + backward) over the whole global batch
    (`frozen_backbone`: only the LoRA adapters are trained)."""
    T = global_batch_size * seq_len
    D, F, K = cfg.base_emb_dim, cfg.base_mlp_dim, cfg.head_dim
    H, G, N = cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.base_num_decoder_layers
    ffn = 2 * T * D * F * 3
    qkv = 2 * T * D * (H + 2 * G) * K
    proj = 2 * T * H * K * D
    causal_attention = 4 * T * seq_len * H * K / 2
    lm_head = 2 * T * D * cfg.vocab_size
    adapters = sum(2 * T * cfg.lora_rank * (k + n) for k, n in _adapted_shapes(cfg))
    weights = 2 if frozen_backbone else 3
    vision = _vision_flops(cfg, global_batch_size) if cfg.model_type == "vlm" else 0
    return float(weights * ((ffn + qkv + proj) * N + lm_head) + 3 * (causal_attention + adapters) * N + 3 * vision)


def _vision_flops(cfg: ModelConfig, global_batch_size: int) -> float:
    """The VLM's vision tower's forward FLOPs over the global batch's images."""
    P, E, Fv, D = cfg.num_patches, cfg.vision_emb_dim, cfg.vision_mlp_dim, cfg.base_emb_dim
    Tv = global_batch_size * P
    Q = cfg.patch_size ** 2 * cfg.image_channels
    layer = 2 * Tv * E * Fv * 3 + 2 * Tv * 4 * E * E + 4 * Tv * P * E
    return 2 * Tv * Q * E + layer * cfg.vision_num_layers + 2 * Tv * (E * D + D * D)
