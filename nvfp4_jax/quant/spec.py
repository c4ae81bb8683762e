"""`OperandSpec`: how one GEMM operand is quantized for its role (pure data, no jax).

A linear layer `Y = X . W` quantizes up to six operands (docs/recipes.md's operand table): X and W for
FPROP, dY and (1x16 weights only) W again for DGRAD, X and dY again for WGRAD. Each is a 2-D
tensor whose block axis is the contraction axis of the GEMM it feeds. A spec says which role it
plays and how it is blocked and rounded; the format's block quantizer (`nvfp4.quantize_blocks`,
the Pallas kernels, the xla backend's operand, the health statistics) takes it as is.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

# The operands of one layer's three GEMMs, in the order the custom VJP quantizes them.
ROLES = ("x", "w", "dy", "w_dgrad", "x_wgrad", "dy_wgrad")


@dataclasses.dataclass(frozen=True)
class OperandSpec:
    """One GEMM operand's quantization.

    role: one of `ROLES` (the statistics are recorded under it).
    axis: the block axis (1x16 or 1x32 blocks along it); None for per-tensor scaling (FP8).
    two_d: square tiles of a 2-D weight, 16x16 (NVFP4) or 32x32 (MXFP4) (axis unused: the codes
        pack along the last axis).
    rht: the 16-point Random Hadamard Transform along `axis` first (the WGRAD copies).
    stochastic: stochastic rounding (needs a key), else round to nearest even.
    """

    role: str = "x"
    axis: Optional[int] = -1
    two_d: bool = False
    rht: bool = False
    stochastic: bool = False

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"OperandSpec.role={self.role!r}; allowed: {', '.join(ROLES)}")

    @property
    def label(self) -> str:
        """The spec in words, for error messages."""
        if self.two_d:
            blocks = "2-D tiles"
        elif self.axis is None:
            blocks = "per-tensor"
        else:
            blocks = f"blocks along axis {self.axis}"
        extra = "".join((", RHT" if self.rht else "", ", SR" if self.stochastic else ""))
        return f"{self.role} ({blocks}{extra})"
