"""Typed run configuration: the one source of defaults.

A run is described by one frozen `Config` made of four sections. The dataclasses (`schema.py`)
hold every default; YAML presets (`recipes/configs/*.yml`) and `key=value` command-line overrides
only change them. Keys are MaxText's flat names (`per_device_batch_size=4`), each owned by exactly one section;
`section.key=value` is accepted too. `model_name` picks a shape preset, applied before the YAML
file's and the command line's own model keys.

Everything is validated before anything is compiled: unknown keys name the closest valid key, bad
values name the key and what is allowed.
"""

from __future__ import annotations

# The package's modules, one concept each: choices (every key's allowed names), schema (the
# dataclasses), presets, overrides (key resolution and coercion), yaml_file, validate, make.
from nvfp4_jax.config.choices import (
    ATTENTION_KERNELS, ATTENTION_QUANTIZATION_FLAGS, CONTEXT_PARALLEL_STRATEGIES, DATASET_TYPES,
    EVAL_QUANTIZATIONS, PROFILERS, QUANT_KERNELS, QUANTIZATION_BACKENDS, QUANTIZATION_FLAGS,
    LORA_TARGETS, REMAT_POLICIES, TOKENIZER_TYPES, TRAIN_PARAMS,
)
from nvfp4_jax.config.errors import ConfigError
from nvfp4_jax.config.make import config_layers, from_dict, load_config, make_config, save_json, to_dict
from nvfp4_jax.config.overrides import parse_overrides
from nvfp4_jax.config.presets import MODEL_PRESETS
from nvfp4_jax.config.schema import (
    KEY_SECTIONS, Config, DataConfig, MeshConfig, ModelConfig, TrainConfig,
)
from nvfp4_jax.config.validate import INT32_MAX, _block_size, global_batch_size, validate
from nvfp4_jax.config.yaml_file import load_yaml

__all__ = [
    "ATTENTION_KERNELS", "ATTENTION_QUANTIZATION_FLAGS", "CONTEXT_PARALLEL_STRATEGIES", "DATASET_TYPES",
    "EVAL_QUANTIZATIONS", "INT32_MAX", "KEY_SECTIONS", "LORA_TARGETS", "MODEL_PRESETS", "TRAIN_PARAMS", "PROFILERS", "QUANT_KERNELS",
    "QUANTIZATION_BACKENDS", "QUANTIZATION_FLAGS", "REMAT_POLICIES", "TOKENIZER_TYPES", "Config",
    "ConfigError", "DataConfig", "MeshConfig", "ModelConfig", "TrainConfig", "_block_size",
    "config_layers", "from_dict", "global_batch_size", "load_config", "load_yaml", "make_config",
    "parse_overrides", "save_json", "to_dict", "validate",
]
