"""The choices of every config key that takes one of a few names: owned here, once.

Each list is a `Literal` type (what the schema's field is annotated with) and the tuple of its
names, which validation checks against and which the implementation that handles the choice
imports (tests/test_config_choices.py holds each implementation to its list). No jax: a bad
choice fails before jax loads. The quantization recipes, backends and operand kernels are owned
by `nvfp4_jax.quant.recipe` (jax-free too), re-exported here under the config's names.
"""

from __future__ import annotations

from typing import Literal, get_args

from nvfp4_jax.quant.recipe import BACKENDS, RECIPES
from nvfp4_jax.quant.recipe import QUANT_KERNELS as QUANT_KERNELS  # re-exported: the config's name

# Flags understood by nvfp4_jax.quant.get_recipe (MaxText's names), from the recipe table itself.
QUANTIZATION_FLAGS = tuple(RECIPES)
# Which code runs the MLP GEMMs (nvfp4_jax.quant.backends; docs/backends.md), and who computes
# NVFP4 GEMM operands (nvfp4_jax.kernels.select): both from the recipe module.
QUANTIZATION_BACKENDS = BACKENDS

AttentionQuantization = Literal["", "bf16", "fp8"]
ATTENTION_QUANTIZATION_FLAGS: tuple[str, ...] = get_args(AttentionQuantization)

# MaxText's attention kernel names (nvfp4_jax.model.attention runs them): `autoselected` picks one
# of the resolved kernels at start-up; an alias names the same kernel as another ("cudnn_flash_te"
# is MaxText's name for Transformer Engine's fused attention, which is cudnn_flash here).
AttentionKernel = Literal["autoselected", "dot_product", "cudnn_flash", "cudnn_flash_te", "chunked"]
ATTENTION_KERNELS: tuple[str, ...] = get_args(AttentionKernel)
ATTENTION_KERNEL_ALIASES = {"cudnn_flash_te": "cudnn_flash"}
RESOLVED_ATTENTION_KERNELS = tuple(k for k in ATTENTION_KERNELS
                                   if k != "autoselected" and k not in ATTENTION_KERNEL_ALIASES)

# MaxText's remat policy names (the ones that apply to this model; nvfp4_jax.model.llama) plus
# "none": no remat.
RematPolicy = Literal["none", "full", "minimal", "minimal_with_context", "save_dot_except_mlp"]
REMAT_POLICIES: tuple[str, ...] = get_args(RematPolicy)

# How attention runs when the sequence is split over the `context` mesh axis (MaxText's names;
# nvfp4_jax.model.ulysses): all_gather gathers K/V along the sequence; ulysses exchanges sequence
# shards for head shards.
ContextStrategy = Literal["all_gather", "ulysses"]
CONTEXT_PARALLEL_STRATEGIES: tuple[str, ...] = get_args(ContextStrategy)

# Where tokens come from (nvfp4_jax.data.streams); the document datasets go through a tokenizer
# and packing (nvfp4_jax.data.documents), the others are token streams.
DatasetType = Literal["shakespeare", "synthetic", "text", "tokens", "grain", "hf", "digits", "image_text"]
DATASET_TYPES: tuple[str, ...] = get_args(DatasetType)
DOCUMENT_DATASET_TYPES = ("grain", "hf")
# Image-text examples for model_type=vlm (nvfp4_jax.data.image_batches): scikit-learn's bundled
# handwritten digits, or the user's images and a JSONL of {image, prompt, answer}.
IMAGE_DATASET_TYPES = ("digits", "image_text")
# Corpora whose bytes are their tokens.
BYTE_DATASET_TYPES = ("shakespeare", "text")

# Which model the builder makes (nvfp4_jax.train.build.MODEL_CLASSES): the Llama decoder, or a
# vision-language model (nvfp4_jax.model.vlm: a ViT encoder and projector before that decoder).
ModelType = Literal["llama", "vlm"]
MODEL_TYPES: tuple[str, ...] = get_args(ModelType)

# nvfp4_jax.data.tokenizer.
TokenizerType = Literal["bytes", "huggingface", "sentencepiece", "tiktoken"]
TOKENIZER_TYPES: tuple[str, ...] = get_args(TokenizerType)

Profiler = Literal["", "xplane"]
PROFILERS: tuple[str, ...] = get_args(Profiler)

# Which forward pass evaluates (TrainConfig.eval_quantization).
EvalQuantization = Literal["train", "bf16", "both"]
EVAL_QUANTIZATIONS: tuple[str, ...] = get_args(EvalQuantization)

# nvfp4_jax.model.lora: the projections a LoRA adapter can sit beside (ModelConfig.lora_targets,
# a comma-separated list of them), and what the optimizer trains (TrainConfig.train_params).
LoraTarget = Literal["query", "key", "value", "out", "gate", "up", "down"]
LORA_TARGETS: tuple[str, ...] = get_args(LoraTarget)
TrainParams = Literal["auto", "all", "adapters"]
TRAIN_PARAMS: tuple[str, ...] = get_args(TrainParams)
