"""GEMM recipes: which number format each operand of a linear layer's three GEMMs gets.

A recipe is data. `Recipe` holds the numerics choices, `RECIPES` maps the user-facing flag
strings (MaxText's names) to instances, and `get_recipe` resolves a flag (once, at the config);
`operand_specs` says how each GEMM operand of the recipe is quantized.
`nvfp4_jax.quant.dot` turns a recipe into a quantized `dot_general`.

This module imports no jax: `nvfp4_jax.config` takes its flag choices from here, so a bad flag
fails before jax is loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Mapping, Optional, get_args

from nvfp4_jax.quant.spec import ROLES, OperandSpec

Format = Literal["bf16", "nvfp4", "mxfp4", "fp8"]

_FORMATS = ("bf16", "nvfp4", "mxfp4", "fp8")
_FP8_SCALINGS = ("delayed", "current")
# The element formats fix their block sizes; a field that could take other values would lie.
_BLOCK_SIZES = {"bf16": None, "nvfp4": 16, "mxfp4": 32, "fp8": None}
# The block-scaled 4-bit formats: the ones the NVFP4 recipe's 2-D weights, RHT and SR apply to.
_FP4_FORMATS = ("nvfp4", "mxfp4")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The numerics of one linear layer's FPROP, DGRAD and WGRAD GEMMs.

    Why these fields (docs/recipes.md and docs/numerics.md):

    - `format`: the element format of every GEMM operand. "bf16" is plain `lax.dot_general`;
      "nvfp4" is E2M1 with E4M3 block scales and an fp32 per-tensor scale; "mxfp4" is E2M1 with
      E8M0 power-of-two block scales and no per-tensor scale; "fp8" is per-tensor scaled FP8
      (E4M3 for X and W, E5M2 for gradients: TE's HYBRID format).
    - `block_size`: elements per block scale (16 for NVFP4, 32 for MXFP4, None otherwise).
    - `two_d_weights`: NVFP4 weights use 16x16 tiles, so the quantized W and W^T hold the same
      numbers and FPROP and DGRAD see one weight (the chain rule stays consistent). False is the
      "1x16 weights" ablation: W is quantized along K for FPROP and along N for DGRAD.
    - `rht_wgrad`: the Random Hadamard Transform on both WGRAD operands along the token axis.
      It spreads outliers across each 16-block before quantization and cancels inside the GEMM.
    - `sr_gradients`: stochastic rounding of the output gradient dY (both its DGRAD and WGRAD
      copies), which keeps the weight update unbiased. X and W always round to nearest.

      These three are the NVFP4 recipe's operand handling, not properties of the NVFP4 format:
      MXFP4 takes them too (32x32 weight tiles, the same 16-point RHT, the same SR), so that
      `mxfp4_nvfp4_recipe` differs from `te_nvfp4` in the format alone.
    - `fp8_scaling`: "delayed" takes each tensor's scale from an amax history of earlier steps
      (state carried by the train step, see `fp8_delayed`); "current" from the tensor itself.
    - `amax_history_len`, `margin`: TE `DelayedScaling` defaults (1024, 0); the scale is
      `fp8_max / max(history) / 2**margin`.

    Which code runs these numerics (emulated, jax.nn.scaled_matmul, Transformer Engine) is not
    part of the recipe: see `nvfp4_jax.quant.backends` and the `quantization_backend` key.
    """

    format: Format = "bf16"
    block_size: int | None = None
    two_d_weights: bool = False
    rht_wgrad: bool = False
    sr_gradients: bool = False
    fp8_scaling: Literal["delayed", "current"] = "current"
    amax_history_len: int = 1024
    margin: int = 0

    def __post_init__(self):
        if self.format not in _FORMATS:
            raise ValueError(f"Recipe.format={self.format!r}; allowed: {_FORMATS}")
        if self.fp8_scaling not in _FP8_SCALINGS:
            raise ValueError(f"Recipe.fp8_scaling={self.fp8_scaling!r}; allowed: {_FP8_SCALINGS}")
        want = _BLOCK_SIZES[self.format]
        if self.block_size != want:
            raise ValueError(
                f"Recipe.block_size={self.block_size!r} with format={self.format!r}; "
                f"that format requires block_size={want!r}"
            )
        fp4_options = self.two_d_weights or self.rht_wgrad or self.sr_gradients
        if self.format not in _FP4_FORMATS and fp4_options:
            raise ValueError(
                f"two_d_weights/rht_wgrad/sr_gradients are FP4 options (nvfp4, mxfp4); "
                f"format={self.format!r} "
                f"got two_d_weights={self.two_d_weights}, rht_wgrad={self.rht_wgrad}, "
                f"sr_gradients={self.sr_gradients}"
            )
        if self.amax_history_len < 1:
            raise ValueError(f"Recipe.amax_history_len={self.amax_history_len}; must be >= 1")

    @property
    def is_bf16(self) -> bool:
        return self.format == "bf16"

    @property
    def needs_rng(self) -> bool:
        """True when the GEMM draws random bits (stochastic rounding) and so needs a key."""
        return self.format in _FP4_FORMATS and self.sr_gradients

    @property
    def fp8_delayed(self) -> bool:
        """True when the recipe carries amax-history state between steps."""
        return self.format == "fp8" and self.fp8_scaling == "delayed"


_NVFP4 = Recipe(format="nvfp4", block_size=16, two_d_weights=True, rht_wgrad=True, sr_gradients=True)

RECIPES: Mapping[str, Recipe] = {
    "": Recipe(),
    "bf16": Recipe(),
    "te_nvfp4": _NVFP4,
    "te_nvfp4_no_rht": dataclasses.replace(_NVFP4, rht_wgrad=False),
    "te_fp8_delayedscaling": Recipe(format="fp8", fp8_scaling="delayed"),
    "te_fp8_currentscaling": Recipe(format="fp8", fp8_scaling="current"),
    "nvfp4_no_sr": dataclasses.replace(_NVFP4, sr_gradients=False),
    "nvfp4_1d_weights": dataclasses.replace(_NVFP4, two_d_weights=False),
    "mxfp4": Recipe(format="mxfp4", block_size=32),
    # MXFP4's format under the NVFP4 recipe's operand handling: only the format differs from
    # te_nvfp4, so the two arms compare formats.
    "mxfp4_nvfp4_recipe": dataclasses.replace(_NVFP4, format="mxfp4", block_size=32),
}


# Which code runs the quantized GEMMs (`quantization_backend`, see `nvfp4_jax.quant.backends`)
# and who computes NVFP4 operands (`quant_kernels`, see `nvfp4_jax.kernels.select`).
Backend = Literal["auto", "emulated", "xla", "te"]
QuantKernels = Literal["auto", "pallas", "jnp"]
BACKENDS: tuple[str, ...] = get_args(Backend)
QUANT_KERNELS: tuple[str, ...] = get_args(QuantKernels)


# The attention projections' recipe under `attention_quantization=fp8`: stateless FP8, per tensor.
ATTENTION_FP8_FLAG = "te_fp8_currentscaling"


def get_recipe(flag: str) -> Recipe:
    """The `Recipe` of a quantization flag (e.g. "te_nvfp4"; "" is bf16): the config's string
    becomes a recipe here, once; everything below the config takes the `Recipe`.

    Raises ValueError for an unknown flag, listing the valid ones.
    """
    if isinstance(flag, str) and flag in RECIPES:
        return RECIPES[flag]
    valid = ", ".join(repr(k) for k in RECIPES)
    raise ValueError(f"unknown quantization recipe {flag!r}; valid flags: {valid}")


def require_recipe(recipe: Recipe, where: str) -> Recipe:
    """`recipe`, or TypeError when it is not a `Recipe` (a flag string is resolved once, by the
    caller, with `get_recipe`)."""
    if isinstance(recipe, Recipe):
        return recipe
    hint = f": resolve the flag once with get_recipe({recipe!r})" if isinstance(recipe, str) else ""
    raise TypeError(f"{where} takes a Recipe, not {recipe!r}{hint}")


def recipe_name(recipe: Recipe) -> str:
    """The flag of a recipe, or its repr if no flag matches."""
    for flag, r in RECIPES.items():
        if flag and r == recipe:
            return flag
    return repr(recipe)


def operand_specs(recipe: Recipe) -> dict[str, Optional[OperandSpec]]:
    """How `recipe` quantizes each operand of its three GEMMs, by role (`spec.ROLES` order).

    None marks an operand the backward does not quantize again: it reuses the forward's
    quantized tensor (`w_dgrad`: W under 2-D tiles, or any FP8 W; `x_wgrad`: FP8 X) or the
    DGRAD copy (`dy_wgrad`: FP8 dY). Per-tensor FP8 operands have no block axis (axis None).
    NVFP4 and MXFP4 share the roles and axes; only the block quantizer behind them differs.
    A BF16 recipe quantizes nothing: {}.
    """
    r = recipe
    if r.format in _FP4_FORMATS:
        sr = r.sr_gradients
        specs = dict(
            x=OperandSpec("x", axis=1),
            w=OperandSpec("w", axis=0, two_d=r.two_d_weights),
            dy=OperandSpec("dy", axis=1, stochastic=sr),
            # 2-D tiles (16x16, 32x32) make the quantized W its own transpose: DGRAD reuses it.
            w_dgrad=None if r.two_d_weights else OperandSpec("w_dgrad", axis=1),
            x_wgrad=OperandSpec("x_wgrad", axis=0, rht=r.rht_wgrad),
            dy_wgrad=OperandSpec("dy_wgrad", axis=0, rht=r.rht_wgrad, stochastic=sr),
        )
    elif r.format == "fp8":
        # Per-tensor scales make every quantized tensor its own transpose.
        specs = dict(x=OperandSpec("x", axis=None), w=OperandSpec("w", axis=None),
                     dy=OperandSpec("dy", axis=None))
    else:
        return {}
    return {role: specs.get(role) for role in ROLES}
