"""Typed run configuration: the one source of defaults.

A run is described by one frozen `Config` made of four sections. The dataclasses below hold every
default; YAML presets (`recipes/configs/*.yml`) and `key=value` command-line overrides only change
them. Keys are MaxText's flat names (`per_device_batch_size=4`), each owned by exactly one section;
`section.key=value` is accepted too. `model_name` picks a shape preset, applied before the YAML
file's and the command line's own model keys.

Everything is validated before anything is compiled: unknown keys name the closest valid key, bad
values name the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import Any, Mapping, Sequence

import yaml

from nvfp4_jax.quant.recipe import BACKENDS, QUANT_KERNELS, RECIPES  # jax-free: the one source

# Flags understood by nvfp4_jax.quant.get_recipe (MaxText's names), from the recipe table itself.
QUANTIZATION_FLAGS = tuple(RECIPES)
ATTENTION_QUANTIZATION_FLAGS = ("", "bf16", "fp8")
# MaxText's attention kernel names; "cudnn_flash_te" is MaxText's name for the same fused kernel.
ATTENTION_KERNELS = ("autoselected", "dot_product", "cudnn_flash", "cudnn_flash_te", "chunked")
# MaxText's remat policy names (the ones that apply to this model) plus "none": no remat.
REMAT_POLICIES = ("none", "full", "minimal", "minimal_with_context", "save_dot_except_mlp")
# Which code runs the MLP GEMMs (nvfp4_jax.quant.backends; docs/backends.md), and who computes
# NVFP4 GEMM operands (nvfp4_jax.kernels.select): both from the recipe module.
QUANTIZATION_BACKENDS = BACKENDS
# How attention runs when the sequence is split over the `context` mesh axis (MaxText's names):
# all_gather gathers K/V along the sequence; ulysses exchanges sequence shards for head shards.
CONTEXT_PARALLEL_STRATEGIES = ("all_gather", "ulysses")
DATASET_TYPES = ("shakespeare", "synthetic", "text", "tokens", "grain", "hf")
TOKENIZER_TYPES = ("bytes", "huggingface", "sentencepiece", "tiktoken")
PROFILERS = ("", "xplane")
# Which forward pass evaluates (TrainConfig.eval_quantization).
EVAL_QUANTIZATIONS = ("train", "bf16", "both")
# LoRA adapters (model/lora.py): the projections one can sit beside, and what a run trains.
LORA_TARGETS = ("query", "key", "value", "out", "gate", "up", "down")
TRAIN_PARAMS = ("auto", "all", "adapters")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama 3 decoder shape and its numerics policy."""

    model_name: str = "tiny"
    vocab_size: int = 256
    base_emb_dim: int = 128
    base_num_query_heads: int = 4
    base_num_kv_heads: int = 2
    head_dim: int = 32
    base_mlp_dim: int = 384
    base_num_decoder_layers: int = 4
    max_target_length: int = 128
    rope_max_timescale: float = 500_000.0
    # Llama 3.1 rotary frequency scaling; factor 1.0 disables it.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    normalization_layer_epsilon: float = 1e-5
    dtype: str = "bfloat16"
    weight_dtype: str = "float32"
    # MLP GEMM recipe (nvfp4_jax.quant flag) and the attention projections' policy.
    quantization: str = ""
    attention_quantization: str = ""
    # auto: xla where jax.nn.scaled_matmul reaches FP4 tensor cores, else emulated; never te.
    quantization_backend: str = "auto"
    # NVFP4 operand quantizer: auto (Pallas kernels on one NVIDIA GPU after a bitwise
    # self-check, else jnp), pallas, or jnp. Same bits either way.
    quant_kernels: str = "auto"
    # Backend fidelity (docs/backends.md). The quantized dots take the kernel in the compute
    # dtype, as MaxText casts it and Transformer Engine quantizes it; true quantizes the fp32
    # master kernel instead (research). The weight gradient is fp32 either way.
    quantize_fp32_kernel: bool = False
    # Accept quantization_backend=xla where XLA only rewrites scaled_matmul into
    # dequantize-then-dot (no FP4 tensor cores, slower than emulated); false: an error.
    xla_dequantize_fallback: bool = False
    # The paper keeps a few decoder layers in BF16; these count from each end.
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    # Attention kernel: autoselected picks cudnn_flash on NVIDIA GPUs that run it, else
    # chunked above 2048 tokens (memory linear in L) and dot_product up to it (scores and
    # softmax in fp32, materialised per head).
    attention: str = "autoselected"
    # Long context: attention's algorithm under ici/dcn_context_parallelism > 1
    # (CONTEXT_PARALLEL_STRATEGIES; nvfp4_jax.model.ulysses).
    context_parallel_strategy: str = "all_gather"
    # --- chunked attention (attention=chunked) ---
    # Queries and keys per block of its online softmax (MaxText's sa_block_q/sa_block_kv in
    # one key); any sequence length works (padded up to whole blocks inside).
    attention_chunk_size: int = 512
    # Decoder layers under one scan (compile time flat in depth; parameters stacked on a
    # leading "layers" axis) or unrolled (`layers_{i}`). Checkpoints hold one layout or the other.
    scan_layers: bool = True
    # What each decoder layer keeps for its backward pass (jax.checkpoint policy).
    remat_policy: str = "none"
    # The loss computes logits and their gradient for 1/num_vocab_tiling of the sequence at a
    # time (recomputed in the backward pass), never for the whole batch at once; 1: no tiling.
    num_vocab_tiling: int = 1
    # --- LoRA adapters (nvfp4_jax/model/lora.py) ---
    # Rank of a low-rank adapter beside each targeted projection (0: none), its scale numerator
    # (the update is alpha / rank * x A B), and the targeted projections (LORA_TARGETS).
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = "query,key,value,out,gate,up,down"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    # shakespeare: the bundled corpus; synthetic: random tokens; text: a UTF-8 file (byte
    # tokens); tokens: a pre-tokenized flat binary of token ids (numpy memmap).
    dataset_type: str = "shakespeare"
    dataset_path: str = ""
    # Token dtype of a `tokens` file.
    token_dtype: str = "uint16"
    # Fraction of the corpus (its tail) held out for evaluation.
    eval_fraction: float = 0.05
    # --- Documents: tokenizers, Grain / Hugging Face files, packing (nvfp4_jax/data) ---
    # grain: local ArrayRecord (from `python -m nvfp4_jax.data prepare`) or Parquet files; hf:
    # local JSONL/Parquet/Arrow files through `datasets`, offline. Comma-separated globs. Without
    # eval files the last eval_fraction of the train documents is held out.
    grain_train_files: str = ""
    grain_eval_files: str = ""
    # Threads that tokenize text documents at start-up (the batches do not depend on it).
    grain_worker_count: int = 1
    # A `datasets` builder for the files (json, parquet, arrow; empty: from their suffix), or,
    # without hf_train_files, a local dataset folder (save_to_disk, or one of data files).
    hf_path: str = ""
    hf_train_files: str = ""
    hf_eval_files: str = ""
    # The text column of JSONL/Parquet/Arrow rows (MaxText's name; one column).
    train_data_columns: str = "text"
    # bytes | huggingface (tokenizer.json) | sentencepiece (.model) | tiktoken (BPE file).
    tokenizer_type: str = "bytes"
    tokenizer_path: str = ""
    add_bos: bool = True
    add_eos: bool = True
    # Several documents per row with segment ids and positions (MaxText's default), or one per row.
    packing: bool = True
    # A resume compares the data and tokenizer files with the fingerprint its checkpoint recorded
    # (nvfp4_jax/data/fingerprint.py) and stops when they changed; true resumes anyway, with a note.
    allow_data_change: bool = False


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer, schedule, loop, logging, checkpoints and profiling."""

    steps: int = 300
    # MaxText's meaning: global batch = per_device_batch_size x devices. Fractional when
    # context parallelism splits one sequence over several devices (0.125 x 8 devices = 1).
    per_device_batch_size: float = 8.0
    learning_rate: float = 3e-3
    warmup_steps_fraction: float = 0.1
    cosine_learning_rate_final_fraction: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    adam_weight_decay: float = 0.1
    gradient_clipping_threshold: float = 1.0
    # From this step on every quantized GEMM runs in BF16 (-1: never).
    quantization_end_step: int = -1
    seed: int = 0
    log_period: int = 10
    eval_interval: int = 100
    eval_steps: int = 4
    # At each evaluation, measure what quantization does to every quantized GEMM operand
    # (nvfp4_jax.quant.health) on the first held-out batch; written to metrics.jsonl.
    quant_stats: bool = False
    run_name: str = ""
    base_output_directory: str = "runs"
    enable_checkpointing: bool = True
    checkpoint_period: int = 100
    max_checkpoints_to_keep: int = 3
    # On resume, a newest checkpoint that cannot be read or fails verification is set aside and
    # the next newest intact one restored; false stops the run instead.
    checkpoint_fallback: bool = True
    profiler: str = ""
    profile_start_step: int = 5
    profile_steps: int = 3
    # --- evaluation modes ---
    # Which forward pass computes the validation loss: "train" (the training recipe's, BF16 once
    # quantization_end_step has passed), "bf16" (the same weights with BF16 dots: the model a
    # user ships), or "both" (eval_loss as "train", plus eval_loss_bf16).
    eval_quantization: str = "train"
    # --- Checkpoint interop and TensorBoard (MaxText's keys) ---
    # A parameters checkpoint (`python -m nvfp4_jax.convert from-hf`) to start from: its
    # parameters, a fresh optimizer, step 0. Ignored once the run has checkpoints of its own.
    load_parameters_path: str = ""
    # Step metrics as TensorBoard scalars in <run dir>/tensorboard/ (extra `tensorboard`;
    # without it a warning, and the run goes on).
    enable_tensorboard: bool = True
    # What the optimizer trains (TRAIN_PARAMS): all parameters, or the LoRA adapters alone with
    # the backbone frozen (no weight gradient, no optimizer state for it); auto: adapters when
    # lora_rank > 0, else all.
    train_params: str = "auto"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh (MaxText's names; -1 means 'the rest of the devices')."""

    ici_data_parallelism: int = 1
    ici_fsdp_parallelism: int = -1
    dcn_data_parallelism: int = 1
    # Long context and tensor parallelism: `context` splits every activation's
    # sequence axis (dcn x ici devices), `tensor` splits attention heads and the MLP width.
    ici_context_parallelism: int = 1
    dcn_context_parallelism: int = 1
    ici_tensor_parallelism: int = 1
    # Multi-host start-up; empty/-1 means "read the usual environment variables".
    coordinator_address: str = ""
    num_processes: int = -1
    process_id: int = -1


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()


_SECTION_CLASSES = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "mesh": MeshConfig}
# Flat key -> section name.
KEY_SECTIONS = {
    f.name: section for section, cls in _SECTION_CLASSES.items() for f in dataclasses.fields(cls)
}

# Published shapes. vocab sizes are the real tokenizers'; `tiny` trains in minutes on 2 cores.
# The two CPU-sized presets keep their few small layers unrolled: on 2 CPU cores a scanned step
# was 1.1-1.3x slower (benchmarks/README.md), and their compile time is seconds either way.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=256, base_emb_dim=128, base_num_query_heads=4, base_num_kv_heads=2,
        head_dim=32, base_mlp_dim=384, base_num_decoder_layers=4, rope_scaling_factor=1.0,
        scan_layers=False,
    ),
    # About 25M parameters, for the step benchmark.
    "small-25m": dict(
        vocab_size=256, base_emb_dim=512, base_num_query_heads=8, base_num_kv_heads=4,
        head_dim=64, base_mlp_dim=1536, base_num_decoder_layers=8, rope_scaling_factor=1.0,
        scan_layers=False,
    ),
    "llama3-8b": dict(
        vocab_size=128256, base_emb_dim=4096, base_num_query_heads=32, base_num_kv_heads=8,
        head_dim=128, base_mlp_dim=14336, base_num_decoder_layers=32,
        rope_max_timescale=500_000.0, rope_scaling_factor=1.0, normalization_layer_epsilon=1e-5,
    ),
    "llama3.1-405b": dict(
        vocab_size=128256, base_emb_dim=16384, base_num_query_heads=128, base_num_kv_heads=8,
        head_dim=128, base_mlp_dim=53248, base_num_decoder_layers=126,
        rope_max_timescale=500_000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_position=8192,
        normalization_layer_epsilon=1e-5,
    ),
}


class ConfigError(ValueError):
    """A configuration key or value that cannot be used."""


def _closest(key: str, options) -> str:
    match = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def _field_types(cls) -> dict[str, type]:
    hints = {"int": int, "float": float, "str": str, "bool": bool}
    return {f.name: hints[f.type] if isinstance(f.type, str) else f.type for f in dataclasses.fields(cls)}


def _coerce(key: str, value: Any, typ: type) -> Any:
    """Turns a YAML or command-line value into the field's type, or raises ConfigError."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise ConfigError(f"{key}={value!r}: expected a boolean (true/false).")
    if typ is str:
        return "" if value is None else str(value)
    try:
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            if isinstance(value, str) and any(c in value for c in ".eE") and "x" not in value:
                as_float = float(value)
                if not as_float.is_integer():
                    raise ValueError
                return int(as_float)
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: expected {typ.__name__}.") from None


def _resolve_key(key: str) -> tuple[str, str]:
    if not isinstance(key, str):
        raise ConfigError(f"Config key {key!r} must be a name such as steps or learning_rate.")
    if "." in key:
        section, name = key.split(".", 1)
        if section not in _SECTION_CLASSES:
            raise ConfigError(
                f"Unknown config section '{section}' in '{key}'; sections: {sorted(_SECTION_CLASSES)}."
            )
        if KEY_SECTIONS.get(name) != section:
            raise ConfigError(
                f"Unknown config key '{key}'.{_closest(name, [k for k, s in KEY_SECTIONS.items() if s == section])}"
            )
        return section, name
    if key not in KEY_SECTIONS:
        raise ConfigError(f"Unknown config key '{key}'.{_closest(key, KEY_SECTIONS)}")
    return KEY_SECTIONS[key], key


def parse_overrides(args: Sequence[str]) -> dict[str, str]:
    """`["a=1", "b=x"]` -> `{"a": "1", "b": "x"}`; anything else is an error."""
    out: dict[str, str] = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"Expected key=value, got {arg!r}.")
        key, value = arg.split("=", 1)
        out[key.strip()] = value.strip()
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML lets a repeated key overwrite the first silently; a config must say each key once."""

    def construct_mapping(self, node, deep=False):
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key == "<<" or not isinstance(key, (str, int, float, bool)):
                continue  # merge keys and odd keys: PyYAML's own rules and errors apply
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise _DuplicateKey(f"the key {key!r} appears twice (lines {first_line[key]} and {line}); "
                                    "give each key once")
            first_line[key] = line
        return super().construct_mapping(node, deep)


class _DuplicateKey(Exception):
    pass


def load_yaml(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise ConfigError(f"Config file {path!r} does not exist.")
    if os.path.isdir(path):
        raise ConfigError(f"Config file {path!r} is a directory; give a .yml file.")
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as exc:
        raise ConfigError(f"Config file {path!r}: {exc}.") from None
    except OSError as exc:
        raise ConfigError(f"Config file {path!r} cannot be read: {exc.strerror}.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"Config file {path!r} is not UTF-8 text.") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"Config file {path!r} is not valid YAML{where}: {problem}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path!r} must hold a mapping of key: value, got {type(data).__name__}.")
    return data


def make_config(*layers: Mapping[str, Any]) -> Config:
    """Builds a validated Config from override layers applied in order (later layers win).

    The model preset named by the final `model_name` is applied first, under all layers.
    """
    merged: dict[tuple[str, str], Any] = {}
    for layer in layers:
        for key, value in layer.items():
            merged[_resolve_key(key)] = value
    model_name = str(merged.get(("model", "model_name"), ModelConfig.model_name))
    if model_name not in MODEL_PRESETS:
        raise ConfigError(
            f"model_name={model_name!r} is not a known preset; choose one of {sorted(MODEL_PRESETS)}."
        )
    values: dict[str, dict[str, Any]] = {s: {} for s in _SECTION_CLASSES}
    values["model"].update(MODEL_PRESETS[model_name])
    for (section, name), value in merged.items():
        values[section][name] = value
    sections = {}
    for section, cls in _SECTION_CLASSES.items():
        types = _field_types(cls)
        sections[section] = cls(**{k: _coerce(k, v, types[k]) for k, v in values[section].items()})
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def config_layers(argv: Sequence[str] = ()) -> list[Mapping[str, Any]]:
    """`[config.yml] [key=value ...]` -> the layers `make_config` applies (YAML, then overrides)."""
    argv = list(argv)
    layers: list[Mapping[str, Any]] = []
    if argv and "=" not in argv[0]:
        layers.append(load_yaml(argv.pop(0)))
    layers.append(parse_overrides(argv))
    return layers


def load_config(argv: Sequence[str] = ()) -> Config:
    """`[config.yml] [key=value ...]` -> Config (the command-line form)."""
    return make_config(*config_layers(argv))


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
        _check(d.dataset_type not in ("shakespeare", "text"), "tokenizer_type", d.tokenizer_type,
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


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def save_json(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_dict(cfg), f, indent=2, sort_keys=True)


def from_dict(data: Mapping[str, Mapping[str, Any]]) -> Config:
    """Inverse of `to_dict` (reads a saved config.json)."""
    flat = {f"{section}.{k}": v for section, keys in data.items() for k, v in keys.items()}
    return make_config(flat)
