"""The run configuration's schema: four frozen sections and the `Config` that holds them.

Every default lives here. A field whose value is one of a few names is typed with its choices
(`nvfp4_jax.config.choices`), which validation checks.
"""

from __future__ import annotations

import dataclasses

from nvfp4_jax.config.choices import (
    AttentionKernel, AttentionQuantization, ContextStrategy, DatasetType, EvalQuantization, ModelType,
    Profiler, RematPolicy, TokenizerType, TrainParams,
)
from nvfp4_jax.quant.recipe import ATTENTION_FP8_FLAG, Backend, QuantKernels, Recipe, get_recipe


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
    attention_quantization: AttentionQuantization = ""
    # auto: xla where jax.nn.scaled_matmul reaches FP4 tensor cores, else emulated; never te.
    quantization_backend: Backend = "auto"
    # NVFP4 operand quantizer: auto (Pallas kernels on one NVIDIA GPU after a bitwise
    # self-check, else jnp), pallas, or jnp. Same bits either way.
    quant_kernels: QuantKernels = "auto"
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
    attention: AttentionKernel = "autoselected"
    # Long context: attention's algorithm under ici/dcn_context_parallelism > 1
    # (CONTEXT_PARALLEL_STRATEGIES; nvfp4_jax.model.ulysses).
    context_parallel_strategy: ContextStrategy = "all_gather"
    # --- chunked attention (attention=chunked) ---
    # Queries and keys per block of its online softmax (MaxText's sa_block_q/sa_block_kv in
    # one key); any sequence length works (padded up to whole blocks inside).
    attention_chunk_size: int = 512
    # Decoder layers under one scan (compile time flat in depth; parameters stacked on a
    # leading "layers" axis) or unrolled (`layers_{i}`). Checkpoints hold one layout or the other.
    scan_layers: bool = True
    # What each decoder layer keeps for its backward pass (jax.checkpoint policy).
    remat_policy: RematPolicy = "none"
    # The loss computes logits and their gradient for 1/num_vocab_tiling of the sequence at a
    # time (recomputed in the backward pass), never for the whole batch at once; 1: no tiling.
    num_vocab_tiling: int = 1
    # --- LoRA adapters (nvfp4_jax/model/lora.py) ---
    # Rank of a low-rank adapter beside each targeted projection (0: none), its scale numerator
    # (the update is alpha / rank * x A B), and the targeted projections (choices.LORA_TARGETS).
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = "query,key,value,out,gate,up,down"
    # --- Vision-language model (model_type=vlm; nvfp4_jax/model/vlm.py, docs/vlm.md) ---
    # llama: the decoder alone; vlm: a ViT encoder + projector whose image tokens come first.
    model_type: ModelType = "llama"
    # The vision tower's MLP (and projector) GEMM recipe; "" follows `quantization`.
    vision_quantization: str = ""
    # Square images of image_size x image_size pixels, image_channels channels, cut into
    # (image_size / patch_size)^2 patches: the image tokens ahead of the text.
    image_size: int = 8
    image_channels: int = 1
    patch_size: int = 2
    vision_emb_dim: int = 64
    vision_num_heads: int = 4
    vision_mlp_dim: int = 128
    vision_num_layers: int = 2

    # The recipes of the config's quantization flags: the one place a flag becomes a `Recipe`.
    @property
    def mlp_recipe(self) -> Recipe:
        """The decoder MLPs' GEMM recipe (`quantization`; "" is BF16)."""
        return get_recipe(self.quantization)

    @property
    def attention_recipe(self) -> Recipe:
        """The attention projections' GEMM recipe: stateless FP8 under `attention_quantization=fp8`,
        else BF16."""
        return get_recipe(ATTENTION_FP8_FLAG if self.attention_quantization == "fp8" else "bf16")

    @property
    def vision_recipe(self) -> Recipe:
        """The vision tower's GEMM recipe: `vision_quantization`, else the decoder's."""
        return get_recipe(self.vision_quantization or self.quantization)

    @property
    def text_length(self) -> int:
        """Text tokens per row: max_target_length, less the image tokens of model_type=vlm."""
        return self.max_target_length - (self.num_patches if self.model_type == "vlm" else 0)

    @property
    def num_patches(self) -> int:
        """Image tokens ahead of the text (model_type=vlm)."""
        return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    # shakespeare: the bundled corpus; synthetic: random tokens; text: a UTF-8 file (byte
    # tokens); tokens: a pre-tokenized flat binary of token ids (numpy memmap). For model_type=vlm:
    # digits (scikit-learn's bundled handwritten digits as captions and questions), or image_text
    # (a JSONL at dataset_path of {image, prompt, answer}; images .npy or PNG, paths relative to
    # it). eval_fraction of their images is held out.
    dataset_type: DatasetType = "shakespeare"
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
    tokenizer_type: TokenizerType = "bytes"
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
    profiler: Profiler = ""
    profile_start_step: int = 5
    profile_steps: int = 3
    # --- evaluation modes ---
    # Which forward pass computes the validation loss: "train" (the training recipe's, BF16 once
    # quantization_end_step has passed), "bf16" (the same weights with BF16 dots: the model a
    # user ships), or "both" (eval_loss as "train", plus eval_loss_bf16).
    eval_quantization: EvalQuantization = "train"
    # --- Checkpoint interop and TensorBoard (MaxText's keys) ---
    # A parameters checkpoint (`python -m nvfp4_jax.convert from-hf`) to start from: its
    # parameters, a fresh optimizer, step 0. Ignored once the run has checkpoints of its own.
    load_parameters_path: str = ""
    # Step metrics as TensorBoard scalars in <run dir>/tensorboard/ (extra `tensorboard`;
    # without it a warning, and the run goes on).
    enable_tensorboard: bool = True
    # What the optimizer trains: all parameters, or the LoRA adapters alone with the backbone
    # frozen (no weight gradient, no optimizer state for it); auto: adapters when lora_rank > 0.
    train_params: TrainParams = "auto"


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


SECTION_CLASSES = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "mesh": MeshConfig}
# Flat key -> section name.
KEY_SECTIONS = {
    f.name: section for section, cls in SECTION_CLASSES.items() for f in dataclasses.fields(cls)
}
