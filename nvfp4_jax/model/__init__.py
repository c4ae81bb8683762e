"""Llama 3 decoder; it knows nothing of FP4 beyond the dot_general factories it is given."""

from nvfp4_jax.model.attention import select_attention
from nvfp4_jax.model.layers import PARAM_AXES, DotGeneralFactory
from nvfp4_jax.model.llama import Llama, layer_blocks, layer_is_quantized

__all__ = ["PARAM_AXES", "DotGeneralFactory", "Llama", "layer_blocks", "layer_is_quantized",
           "select_attention"]
