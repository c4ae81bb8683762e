"""Everything that knows FP4/FP8: formats, quantizers, Hadamard transform, recipes, the quantized dot.

Layout (docs/design.md): numerics (`exact`, `formats`, `hadamard`), tensors (`block_tensor`, the
one block-scaled FP4 type, with its formats `nvfp4` and `mxfp4`; `fp8`; `spec.OperandSpec`
describing one GEMM operand; `entry.quantize`, the one entry point to every form), the GEMM (`recipe`, `dot`: the
skeleton, `quantizers`: the quantizer sets, `nvfp4_backend`: the NVFP4 operand-quantizer
protocol, `flax_dot`, `fp8_delayed`, `backends` with `xla_backend` and
`te_backend`), and `health`.

The names below load lazily (PEP 562), so that `nvfp4_jax.quant.recipe`, which `nvfp4_jax.config`
reads its choices from, imports without jax.
"""

import importlib

_EXPORTS = {
    "formats": ("E2M1_VALUES", "e2m1_values", "pack_nibbles", "unpack_nibbles"),
    "fp8": ("FP8Tensor", "dequantize_fp8", "quantize_fp8"),
    "hadamard": ("hadamard_matrix", "inverse_random_hadamard_transform", "random_hadamard_transform"),
    "block_tensor": ("BlockScaledTensor",),
    "entry": ("FORMATS", "FORMS", "dequantize", "quantize"),
    "mxfp4": ("MXFP4Tensor", "dequantize_mxfp4", "quantize_mxfp4", "quantize_mxfp4_spec"),
    "nvfp4": ("NVFP4Tensor", "BlockCodes", "gemm_operand", "nvfp4_gemm_operand",
              "quantize_blocks", "quantize_nvfp4", "unpack_codes"),
    "spec": ("OperandSpec",),
    # The quantized GEMM: recipes, the dot_general seam, its Flax module, FP8 state.
    "dot": ("make_dot_general",),
    "nvfp4_backend": ("EMULATED", "NVFP4Backend", "emulated_gemm"),
    "quantizers": ("Quantizers",),
    "flax_dot": ("OVERWRITE_WITH_GRADIENT_COLLECTIONS", "QuantDotGeneral", "dot_general_factory",
                 "quant_rngs"),
    "fp8_delayed": ("init_fp8_meta",),
    "recipe": ("ATTENTION_FP8_FLAG", "BACKENDS", "RECIPES", "Recipe", "get_recipe", "operand_specs",
               "recipe_name", "require_recipe"),
    "te_backend": ("TE", "TEBackend", "TEUnavailableError"),
    "xla_backend": ("BlockScaledOperand", "block_scaled_operand", "probe_scaled_matmul",
                    "scaled_matmul_reference", "xla_operand"),
    "backends": ("Backend", "BackendChoice", "check_backend_resume", "choose_backend", "make_backend",
                 "resolve_backend"),
}
_SUBMODULES = ("block_tensor", "entry", "exact", "formats", "fp8", "fp8_delayed", "hadamard", "mxfp4", "nvfp4", "spec", "dot",
               "nvfp4_backend", "quantizers", "flax_dot", "recipe", "te_backend", "xla_backend",
               "backends", "health")
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["exact", "health", *_WHERE]


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
