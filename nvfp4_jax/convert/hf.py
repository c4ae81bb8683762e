"""The one map between Hugging Face Llama and our Llama: config fields and tensor names.

Every HF `*_proj.weight` is `[out, in]`, our `kernel` `[in, out]`: the transpose. Both pair the
rotary dimensions as halves (x[i], x[i + K/2]), so Q/K need no permutation. Norm scales and the
embedding table are the same arrays. Decoder layer i lives in `layers_{i}` (unrolled) or at
index `i - block.start` of its scanned block's stacked arrays (`model.layer_blocks`).

Pure: nothing here reads files or touches devices.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, NamedTuple

from nvfp4_jax.config import ModelConfig
from nvfp4_jax.model import layer_blocks
# Defined with the parameters checkpoint, which training reads.
from nvfp4_jax.train.params_checkpoint import ConvertError

# HF name of decoder layer i's tensors -> (our sub-path inside the layer, transposed?).
_LAYER_TENSORS = {
    "self_attn.q_proj.weight": (("attention", "query", "kernel"), True),
    "self_attn.k_proj.weight": (("attention", "key", "kernel"), True),
    "self_attn.v_proj.weight": (("attention", "value", "kernel"), True),
    "self_attn.o_proj.weight": (("attention", "out", "kernel"), True),
    "mlp.gate_proj.weight": (("mlp", "gate", "kernel"), True),
    "mlp.up_proj.weight": (("mlp", "up", "kernel"), True),
    "mlp.down_proj.weight": (("mlp", "down", "kernel"), True),
    "input_layernorm.weight": (("attention_norm", "scale"), False),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), False),
}
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
_GLOBAL_TENSORS = {
    EMBEDDING: (("token_embedder", "embedding"), False),
    "model.norm.weight": (("final_norm", "scale"), False),
    LM_HEAD: (("lm_head", "kernel"), True),
}
# Buffers some exporters store that carry no parameters (recomputed from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Tensor(NamedTuple):
    """One HF tensor and where it lives in our params tree."""

    hf_name: str
    hf_shape: tuple[int, ...]
    path: tuple[str, ...]  # our params tree path of the (possibly stacked) array
    index: int | None  # position on the stacked layer axis; None: the array itself
    transpose: bool


def _layer_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    D, F, H, G, K = m.base_emb_dim, m.base_mlp_dim, m.base_num_query_heads, m.base_num_kv_heads, m.head_dim
    return {
        "self_attn.q_proj.weight": (H * K, D), "self_attn.k_proj.weight": (G * K, D),
        "self_attn.v_proj.weight": (G * K, D), "self_attn.o_proj.weight": (D, H * K),
        "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F),
        "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
    }


def tensors(m: ModelConfig) -> Iterator[Tensor]:
    """Every HF tensor of `m` (untied: `lm_head.weight` included), in HF's usual order."""
    V, D = m.vocab_size, m.base_emb_dim
    global_shapes = {EMBEDDING: (V, D), "model.norm.weight": (D,), LM_HEAD: (V, D)}

    def global_tensor(name):
        path, transpose = _GLOBAL_TENSORS[name]
        return Tensor(name, global_shapes[name], path, None, transpose)

    yield global_tensor(EMBEDDING)
    shapes = _layer_shapes(m)
    for block in layer_blocks(m):
        for layer in range(block.start, block.stop):
            for suffix, (sub, transpose) in _LAYER_TENSORS.items():
                yield Tensor(f"model.layers.{layer}.{suffix}", shapes[suffix], (block.name,) + sub,
                             layer - block.start if block.scanned else None, transpose)
    yield global_tensor("model.norm.weight")
    yield global_tensor(LM_HEAD)


def param_shapes(m: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Our params tree path -> array shape (stacked arrays carry their block's layer count)."""
    counts = {b.name: b.stop - b.start for b in layer_blocks(m) if b.scanned}
    out = {}
    for t in tensors(m):
        shape = t.hf_shape[::-1] if t.transpose else t.hf_shape
        out[t.path] = ((counts[t.path[0]],) if t.index is not None else ()) + tuple(shape)
    return out


# --- config.json ----------------------------------------------------------------------------


def _get(hf: Mapping[str, Any], key: str, where: str = "config.json"):
    if key not in hf:
        raise ConvertError(f"{where} has no {key!r}; a Llama config.json needs it.")
    return hf[key]


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Our rope keys from transformers 5's `rope_parameters` or the older `rope_theta` +
    `rope_scaling` (Llama 3.1's published config.json)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    out: dict[str, Any] = {"rope_max_timescale": float(theta), "rope_scaling_factor": 1.0}
    if kind == "default":
        return out
    if kind != "llama3":
        raise ConvertError(
            f"config.json rope_type={kind!r} is not supported: only 'default' and Llama 3.1's "
            "'llama3' frequency scaling map onto this model.")
    for ours, theirs in (("rope_scaling_factor", "factor"), ("rope_low_freq_factor", "low_freq_factor"),
                         ("rope_high_freq_factor", "high_freq_factor"),
                         ("rope_original_max_position", "original_max_position_embeddings")):
        out[ours] = _get(merged, theirs, "config.json rope_scaling")
    out["rope_original_max_position"] = int(out["rope_original_max_position"])
    return out


def model_keys_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Our model keys (ARCHITECTURE_KEYS) of an HF Llama config.json; ConvertError for what this
    model cannot represent."""
    if hf.get("model_type", "llama") != "llama":
        raise ConvertError(f"config.json model_type={hf.get('model_type')!r}: only 'llama' converts.")
    for key, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, allowed) != allowed:
            raise ConvertError(f"config.json {key}={hf[key]!r} is not supported: this Llama has "
                               f"{key}={allowed!r}.")
    D, H = int(_get(hf, "hidden_size")), int(_get(hf, "num_attention_heads"))
    head_dim = hf.get("head_dim") or D // H
    return {
        "vocab_size": int(_get(hf, "vocab_size")),
        "base_emb_dim": D,
        "base_num_query_heads": H,
        "base_num_kv_heads": int(hf.get("num_key_value_heads") or H),
        "head_dim": int(head_dim),
        "base_mlp_dim": int(_get(hf, "intermediate_size")),
        "base_num_decoder_layers": int(_get(hf, "num_hidden_layers")),
        "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        **_rope(hf),
    }


def hf_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    """The config.json of `m` for `transformers.LlamaForCausalLM` (untied embeddings)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_max_timescale}
    if m.rope_scaling_factor != 1.0:
        rope.update(rope_type="llama3", factor=m.rope_scaling_factor,
                    low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_max_position)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.base_emb_dim,
        "intermediate_size": m.base_mlp_dim,
        "num_hidden_layers": m.base_num_decoder_layers,
        "num_attention_heads": m.base_num_query_heads,
        "num_key_value_heads": m.base_num_kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": m.normalization_layer_epsilon,
        # Llama 3.1 publishes original x factor (131072); the context the RoPE scaling serves.
        "max_position_embeddings": max(m.max_target_length,
                                       int(m.rope_original_max_position * m.rope_scaling_factor)),
        "rope_parameters": rope,
        "attention_bias": False,
        "mlp_bias": False,
        # Our LM head is its own matrix: tying would throw it away.
        "tie_word_embeddings": False,
        "dtype": dtype,
    }
