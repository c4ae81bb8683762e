"""Every check of a config's values that needs no device: pure, looks at the config only."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from nvfp4_jax.config.choices import (
    ATTENTION_KERNELS, ATTENTION_QUANTIZATION_FLAGS, BYTE_DATASET_TYPES, CONTEXT_PARALLEL_STRATEGIES,
    DATASET_TYPES, EVAL_QUANTIZATIONS, IMAGE_DATASET_TYPES, MODEL_TYPES, PROFILERS, QUANT_KERNELS,
    QUANTIZATION_BACKENDS, QUANTIZATION_FLAGS, REMAT_POLICIES, TOKENIZER_TYPES, LORA_TARGETS, TRAIN_PARAMS,
)
from nvfp4_jax.config.errors import ConfigError
from nvfp4_jax.config.schema import Config, DataConfig, ModelConfig, TrainConfig
from nvfp4_jax.quant.recipe import RECIPES


def global_batch_size(per_device_batch_size: float, num_devices: int) -> int:
    """MaxText's global batch, `per_device_batch_size x devices`, which must be whole sequences."""
    exact = per_device_batch_size * num_devices
    if exact < 1 or abs(exact - round(exact)) > 1e-9:
        raise ConfigError(
            f"per_device_batch_size={per_device_batch_size:g} x {num_devices} devices = {exact:g} "
            "sequences: the global batch must be a whole number >= 1 (fractional per_device_batch_size "
            "is for context parallelism, e.g. 0.125 with 8 devices sharing one sequence)."
        )
    return int(round(exact))


INT32_MAX = 2**31 - 1


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}.")


def _block_size(flag: str) -> int | None:
    """Elements per block scale of a quantization flag (None: per-tensor or no scaling)."""
    return RECIPES[flag].block_size


def _check_run_name(name: str) -> None:
    parts = name.replace("\\", "/").split("/")
    _check(not os.path.isabs(name) and ".." not in parts, "run_name", name,
           "a name (or relative sub-path) inside base_output_directory, without '..' or a leading '/'")


def validate(cfg: Config) -> None:
    """Raises ConfigError for values no run can use. Pure: looks at the config only."""
    m, d, t, mesh = cfg.model, cfg.data, cfg.train, cfg.mesh
    for section in (m, d, t, mesh):
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            if isinstance(value, float):
                _check(math.isfinite(value), field.name, value, "must be a finite number")
            elif isinstance(value, int) and not isinstance(value, bool):
                _check(abs(value) <= INT32_MAX, field.name, value,
                       f"must lie within +-{INT32_MAX} (the step counter, the schedules and the "
                       "data positions are int32 on the device)")
    for key in ("vocab_size", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads",
                "head_dim", "base_mlp_dim", "base_num_decoder_layers", "max_target_length"):
        _check(getattr(m, key) > 0, key, getattr(m, key), "must be a positive integer")
    _check(m.base_num_query_heads % m.base_num_kv_heads == 0, "base_num_kv_heads",
           m.base_num_kv_heads, f"must divide base_num_query_heads={m.base_num_query_heads}")
    _check(m.head_dim % 2 == 0, "head_dim", m.head_dim, "must be even (rotary embedding)")
    _check(m.quantization in QUANTIZATION_FLAGS, "quantization", m.quantization,
           f"choose one of {list(QUANTIZATION_FLAGS)}")
    _check(m.attention_quantization in ATTENTION_QUANTIZATION_FLAGS, "attention_quantization",
           m.attention_quantization, f"choose one of {list(ATTENTION_QUANTIZATION_FLAGS)}")
    _check(m.quantization_backend in QUANTIZATION_BACKENDS, "quantization_backend",
           m.quantization_backend, f"choose one of {list(QUANTIZATION_BACKENDS)}")
    _check(m.quant_kernels in QUANT_KERNELS, "quant_kernels", m.quant_kernels,
           f"choose one of {list(QUANT_KERNELS)}")
    _check(m.dtype in ("bfloat16", "float32"), "dtype", m.dtype, "bfloat16 or float32")
    _check(m.weight_dtype in ("float32",), "weight_dtype", m.weight_dtype,
           "float32 (master weights stay fp32)")
    for key in ("bf16_first_layers", "bf16_last_layers"):
        _check(getattr(m, key) >= 0, key, getattr(m, key), "must be >= 0")
    _check(m.bf16_first_layers + m.bf16_last_layers <= m.base_num_decoder_layers,
           "bf16_first_layers", m.bf16_first_layers,
           f"bf16_first_layers + bf16_last_layers must be <= base_num_decoder_layers={m.base_num_decoder_layers}")
    _validate_layout_keys(m)
    _validate_adapter_keys(m, t)
    block = _block_size(m.quantization)
    if block:  # K and N of every quantized GEMM are blocked axes of some operand
        for key in ("base_emb_dim", "base_mlp_dim"):
            _check(getattr(m, key) % block == 0, key, getattr(m, key),
                   f"quantization={m.quantization!r} needs a multiple of {block}")
    if block:  # the quantized GEMMs block the tokens of each sequence too (WGRAD contracts them)
        _check(m.max_target_length % block == 0, "max_target_length", m.max_target_length,
               f"quantization={m.quantization!r} needs a multiple of {block} (tokens per block scale)")
    for key in ("rope_max_timescale", "rope_scaling_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_position", "normalization_layer_epsilon"):
        _check(getattr(m, key) > 0, key, getattr(m, key), "must be > 0")
    _check(d.dataset_type in DATASET_TYPES, "dataset_type", d.dataset_type,
           f"choose one of {list(DATASET_TYPES)}")
    if d.dataset_type in ("text", "tokens"):
        _check(bool(d.dataset_path), "dataset_path", d.dataset_path,
               f"dataset_type={d.dataset_type!r} needs a file path")
    _check(d.token_dtype in ("uint16", "uint32", "int32"), "token_dtype", d.token_dtype,
           "uint16, uint32 or int32")
    _check(0.0 < d.eval_fraction < 1.0, "eval_fraction", d.eval_fraction, "must lie in (0, 1)")
    _validate_document_keys(d)
    _validate_vision_keys(m, d)
    _check(t.per_device_batch_size > 0, "per_device_batch_size", t.per_device_batch_size,
           "must be > 0 (fractional only when context parallelism shares a sequence)")
    for key in ("steps", "log_period", "eval_interval", "eval_steps",
                "checkpoint_period", "max_checkpoints_to_keep", "profile_steps"):
        _check(getattr(t, key) > 0, key, getattr(t, key), "must be a positive integer")
    _check(t.learning_rate > 0, "learning_rate", t.learning_rate, "must be > 0")
    for key in ("adam_b1", "adam_b2"):
        _check(0.0 <= getattr(t, key) < 1.0, key, getattr(t, key), "must lie in [0, 1)")
    _check(t.adam_eps > 0, "adam_eps", t.adam_eps,
           "must be > 0 (with 0, a parameter whose gradient is exactly 0 gets 0/0 = NaN)")
    _check(t.adam_weight_decay >= 0, "adam_weight_decay", t.adam_weight_decay, "must be >= 0")
    _check(t.quantization_end_step >= -1, "quantization_end_step", t.quantization_end_step,
           "must be a step >= 0, or -1 (never)")
    _check(bool(t.base_output_directory), "base_output_directory", t.base_output_directory,
           "must name a directory")
    _check_run_name(t.run_name)
    _check(0.0 <= t.warmup_steps_fraction < 1.0, "warmup_steps_fraction",
           t.warmup_steps_fraction, "must lie in [0, 1)")
    _check(0.0 <= t.cosine_learning_rate_final_fraction <= 1.0,
           "cosine_learning_rate_final_fraction", t.cosine_learning_rate_final_fraction,
           "must lie in [0, 1]")
    _check(t.gradient_clipping_threshold >= 0, "gradient_clipping_threshold",
           t.gradient_clipping_threshold, "must be >= 0 (0 disables clipping)")
    _check(t.profiler in PROFILERS, "profiler", t.profiler, f"choose one of {list(PROFILERS)}")
    _check(t.eval_quantization in EVAL_QUANTIZATIONS, "eval_quantization", t.eval_quantization,
           f"choose one of {list(EVAL_QUANTIZATIONS)}")
    _check(t.profile_start_step >= 0, "profile_start_step", t.profile_start_step, "must be >= 0")
    for key in ("ici_data_parallelism", "ici_fsdp_parallelism", "dcn_data_parallelism",
                "ici_context_parallelism", "dcn_context_parallelism", "ici_tensor_parallelism"):
        value = getattr(mesh, key)
        _check(value == -1 or value > 0, key, value, "must be a positive integer or -1")


def _validate_document_keys(d: DataConfig) -> None:
    """The tokenizer, Grain/HF file and packing keys (files are checked when the data is opened)."""
    _check(d.tokenizer_type in TOKENIZER_TYPES, "tokenizer_type", d.tokenizer_type,
           f"choose one of {list(TOKENIZER_TYPES)}")
    if d.tokenizer_type != "bytes":
        _check(bool(d.tokenizer_path), "tokenizer_path", d.tokenizer_path,
               f"tokenizer_type={d.tokenizer_type!r} needs a local tokenizer file")
        # Those corpora's bytes are their tokens: another tokenizer would only mislead `sample`.
        _check(d.dataset_type not in BYTE_DATASET_TYPES, "tokenizer_type", d.tokenizer_type,
               f"dataset_type={d.dataset_type!r} is byte tokens; tokenizers apply to grain, hf and tokens")
    _check(d.grain_worker_count >= 0, "grain_worker_count", d.grain_worker_count, "must be >= 0")
    if d.dataset_type == "grain":
        _check(bool(d.grain_train_files), "grain_train_files", d.grain_train_files,
               "dataset_type='grain' needs local files (a comma-separated list of globs)")
    if d.dataset_type == "hf":
        _check(bool(d.hf_train_files or d.hf_path), "hf_train_files", d.hf_train_files,
               "dataset_type='hf' needs local files (comma-separated globs) or hf_path=<a local dataset folder>")
    _check(bool(d.train_data_columns) and "," not in d.train_data_columns, "train_data_columns",
           d.train_data_columns, "one column name")


def _validate_layout_keys(m: ModelConfig) -> None:
    """The attention kernel, layer layout, remat and loss-tiling keys."""
    _check(m.attention in ATTENTION_KERNELS, "attention", m.attention,
           f"choose one of {list(ATTENTION_KERNELS)}")
    _check(m.context_parallel_strategy in CONTEXT_PARALLEL_STRATEGIES, "context_parallel_strategy",
           m.context_parallel_strategy, f"choose one of {list(CONTEXT_PARALLEL_STRATEGIES)}")
    _check(m.attention_chunk_size > 0, "attention_chunk_size", m.attention_chunk_size,
           "must be a positive integer (queries and keys per block of attention=chunked)")
    _check(m.remat_policy in REMAT_POLICIES, "remat_policy", m.remat_policy,
           f"choose one of {list(REMAT_POLICIES)}")
    _check(m.num_vocab_tiling > 0 and m.max_target_length % m.num_vocab_tiling == 0,
           "num_vocab_tiling", m.num_vocab_tiling,
           f"must be a positive divisor of max_target_length={m.max_target_length}")


def _validate_adapter_keys(m: ModelConfig, t: TrainConfig) -> None:
    """The LoRA keys and what the run trains."""
    _check(m.lora_rank >= 0, "lora_rank", m.lora_rank, "must be >= 0 (0: no adapters)")
    _check(m.lora_alpha > 0, "lora_alpha", m.lora_alpha, "must be > 0")
    targets = [name.strip() for name in m.lora_targets.split(",")]
    _check(all(name in LORA_TARGETS for name in targets), "lora_targets", m.lora_targets,
           f"a comma-separated list of {list(LORA_TARGETS)}")
    _check(t.train_params in TRAIN_PARAMS, "train_params", t.train_params, f"choose one of {list(TRAIN_PARAMS)}")
    _check(t.train_params != "adapters" or m.lora_rank > 0, "train_params", t.train_params,
           "'adapters' needs lora_rank > 0 (the adapters to train)")


def _validate_vision_keys(m: ModelConfig, d: DataConfig) -> None:
    """The vision-language model's keys and its data (model_type=vlm)."""
    _check(m.model_type in MODEL_TYPES, "model_type", m.model_type, f"choose one of {list(MODEL_TYPES)}")
    _check(m.vision_quantization in QUANTIZATION_FLAGS, "vision_quantization", m.vision_quantization,
           f"choose one of {list(QUANTIZATION_FLAGS)} ('' follows quantization)")
    for key in ("image_size", "image_channels", "patch_size", "vision_emb_dim", "vision_num_heads",
                "vision_mlp_dim", "vision_num_layers"):
        _check(getattr(m, key) > 0, key, getattr(m, key), "must be a positive integer")
    _check(m.image_size % m.patch_size == 0, "patch_size", m.patch_size,
           f"must divide image_size={m.image_size}")
    _check(m.vision_emb_dim % m.vision_num_heads == 0, "vision_num_heads", m.vision_num_heads,
           f"must divide vision_emb_dim={m.vision_emb_dim}")
    image_data = d.dataset_type in IMAGE_DATASET_TYPES
    if m.model_type != "vlm":
        _check(not image_data, "dataset_type", d.dataset_type, "image-text data needs model_type='vlm'")
        return
    _check(image_data, "dataset_type", d.dataset_type,
           f"model_type='vlm' reads image-text examples: choose one of {list(IMAGE_DATASET_TYPES)}")
    _check(d.dataset_type != "image_text" or bool(d.dataset_path), "dataset_path", d.dataset_path,
           "dataset_type='image_text' needs the JSONL file of {image, prompt, answer}")
    _check(d.tokenizer_type == "bytes", "tokenizer_type", d.tokenizer_type,
           "image-text examples are byte tokens: bytes")
    _check(m.num_patches < m.max_target_length, "max_target_length", m.max_target_length,
           f"must exceed the {m.num_patches} image tokens (image_size / patch_size)^2, leaving room for text")
    text_length = m.max_target_length - m.num_patches
    _check(text_length % m.num_vocab_tiling == 0, "num_vocab_tiling", m.num_vocab_tiling,
           f"must divide the {text_length} text tokens (max_target_length - image tokens)")
    vision_flag = m.vision_quantization or m.quantization
    block = _block_size(vision_flag)
    if block:  # every vision GEMM blocks its K, N and (WGRAD) its tokens, as the decoder's do
        for key in ("vision_emb_dim", "vision_mlp_dim"):
            _check(getattr(m, key) % block == 0, key, getattr(m, key),
                   f"vision_quantization={vision_flag or 'bf16'!r} needs a multiple of {block}")
        _check(m.num_patches % block == 0, "patch_size", m.patch_size,
               f"vision_quantization={vision_flag or 'bf16'!r} needs the (image_size / patch_size)^2 = "
               f"{m.num_patches} image tokens to be a multiple of {block}")
