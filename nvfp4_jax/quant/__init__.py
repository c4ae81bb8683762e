"""Everything that knows FP4/FP8: formats, quantizers, Hadamard transform, recipes, the quantized dot."""

from .formats import E2M1_VALUES, e2m1_values, pack_nibbles, unpack_nibbles
from .fp8 import FP8Tensor, dequantize_fp8, quantize_fp8
from .hadamard import hadamard_matrix, inverse_random_hadamard_transform, random_hadamard_transform
from .mxfp4 import MXFP4Tensor, dequantize_mxfp4, quantize_mxfp4
from . import exact
from .nvfp4 import NVFP4Tensor, dequantize, nvfp4_gemm_operand, quantize_nvfp4, unpack_codes

# The quantized GEMM (issue 3): recipes, the dot_general seam, its Flax module, FP8 state.
from .dot import EMULATED, NVFP4Backend, emulated_gemm, make_dot_general
from .flax_dot import (
    OVERWRITE_WITH_GRADIENT_COLLECTIONS,
    QuantDotGeneral,
    dot_general_factory,
    quant_rngs,
)
from .fp8_delayed import init_fp8_meta
from .recipe import RECIPES, Recipe, get_recipe
from .te_backend import TE, TEBackend, TEUnavailableError
from .xla_backend import BlockScaledOperand, probe_scaled_matmul, scaled_matmul_reference, xla_operand
from .backends import BACKENDS, BackendChoice, check_backend_resume, choose_backend, make_backend

__all__ = [
    "exact",
    "E2M1_VALUES",
    "e2m1_values",
    "pack_nibbles",
    "unpack_nibbles",
    "FP8Tensor",
    "dequantize_fp8",
    "quantize_fp8",
    "hadamard_matrix",
    "inverse_random_hadamard_transform",
    "random_hadamard_transform",
    "MXFP4Tensor",
    "dequantize_mxfp4",
    "quantize_mxfp4",
    "NVFP4Tensor",
    "dequantize",
    "nvfp4_gemm_operand",
    "quantize_nvfp4",
    "unpack_codes",
    "make_dot_general",
    "NVFP4Backend",
    "EMULATED",
    "emulated_gemm",
    "OVERWRITE_WITH_GRADIENT_COLLECTIONS",
    "QuantDotGeneral",
    "dot_general_factory",
    "quant_rngs",
    "init_fp8_meta",
    "RECIPES",
    "Recipe",
    "get_recipe",
    "TE",
    "TEBackend",
    "TEUnavailableError",
    "BlockScaledOperand",
    "probe_scaled_matmul",
    "scaled_matmul_reference",
    "xla_operand",
    "BACKENDS",
    "BackendChoice",
    "check_backend_resume",
    "choose_backend",
    "make_backend",
]
