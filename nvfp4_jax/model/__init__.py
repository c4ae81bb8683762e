"""Llama 3 decoder and the vision-language model around it; they know nothing of FP4 beyond the dot_general factories it is given."""

from nvfp4_jax.model.attention import select_attention
from nvfp4_jax.model.layers import PARAM_AXES, DotGeneralFactory
from nvfp4_jax.model.llama import Llama, layer_blocks, layer_is_quantized
from nvfp4_jax.model.vlm import VLM

__all__ = ["PARAM_AXES", "DotGeneralFactory", "Llama", "layer_blocks", "layer_is_quantized",
           "select_attention", "VLM"]
