"""Optional fast paths for the NVFP4 quantizer: fused Pallas kernels, bit-exact to `nvfp4_jax.quant`.

See kernels/README.md (what each kernel guarantees) and `select` (the `quant_kernels` key).
"""

from .operand import gemm_operand, gemm_operand_pair, quantize_nvfp4
from .quantize import BLOCK_KINDS, Copy, fused_quantize, tile_amax_bits
from .select import OperandKernels, operand_kernels, self_check, with_operand_kernels

__all__ = [
    "BLOCK_KINDS",
    "Copy",
    "OperandKernels",
    "fused_quantize",
    "gemm_operand",
    "gemm_operand_pair",
    "operand_kernels",
    "quantize_nvfp4",
    "self_check",
    "tile_amax_bits",
    "with_operand_kernels",
]
