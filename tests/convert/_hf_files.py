"""Hugging Face Llama folders written by hand (numpy + safetensors, no transformers)."""

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

# GQA (4 query heads, 2 KV heads), head_dim != hidden / heads, Llama 3.1 frequency scaling.
HF_CONFIG = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
    intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, rms_norm_eps=1e-5, hidden_act="silu", max_position_embeddings=64,
    rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=16),
)


def hf_shapes(c):
    """HF's own tensor names and [out, in] shapes (written from the HF layout, not from ours)."""
    D, F, V, K = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    H, G = c["num_attention_heads"], c["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, D)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (H * K, D), p + "self_attn.k_proj.weight": (G * K, D),
            p + "self_attn.v_proj.weight": (G * K, D), p + "self_attn.o_proj.weight": (D, H * K),
            p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F), p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
        })
    return shapes


def write_hf_dir(path, config=None, *, dtype="float32", shards=1, seed=0):
    """config.json + safetensors (an index when `shards` > 1); returns {name: array as stored}."""
    config = dict(HF_CONFIG if config is None else config)
    rng = np.random.default_rng(seed)
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tensors = {}
    for name, shape in hf_shapes(config).items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        tensors[name] = (base + 0.1 * rng.standard_normal(shape)).astype(np_dtype)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "dtype": dtype}, f)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return tensors
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return tensors
