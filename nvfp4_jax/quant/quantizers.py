"""The quantizer sets: what each format (NVFP4, MXFP4, FP8) provides to the quantized dot's
custom-VJP skeleton (`nvfp4_jax.quant.dot`): its operand specs, how to quantize and measure an
operand for its spec, the GEMM on two such operands, and an optional state update (delayed FP8's
amax history)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nvfp4_jax.quant import formats as F
from nvfp4_jax.quant import fp8_delayed, health
from nvfp4_jax.quant.fp8 import quantize_fp8
from nvfp4_jax.quant.mxfp4 import quantize_mxfp4_spec
from nvfp4_jax.quant.entry import dequantize
from nvfp4_jax.quant.nvfp4_backend import EMULATED, SR_DGRAD, SR_WGRAD, NVFP4Backend, bf16_gemm, sr_keys
from nvfp4_jax.quant.recipe import Recipe, operand_specs, recipe_name
from nvfp4_jax.quant.spec import OperandSpec


@dataclasses.dataclass(frozen=True)
class Quantizers:
    """One format's quantizer set (hashable: part of the custom VJP's static argument).

    The skeleton asks it for the recipe's operand specs (`recipe.operand_specs`: None means the
    backward reuses a forward quantization), to quantize an operand for its spec, to measure
    one (`health`), to run a GEMM on two of its operands, and for the next state of a stateful
    recipe. `aux` is the per-call input the operands need: the SR key (NVFP4) or the amax
    history (delayed FP8).
    """

    recipe: Recipe

    @property
    def specs(self) -> dict:
        return operand_specs(self.recipe)

    def aux(self, key, meta):
        return None

    def quantize(self, x, spec: OperandSpec, aux):
        raise NotImplementedError

    def quantize_group(self, items: list, aux) -> list:
        """The `(spec, x)` operands of one pass, quantized (each on its own unless the format
        can do better)."""
        return [self.quantize(x, spec, aux) for spec, x in items]

    def measure(self, x, spec: OperandSpec, aux):
        raise NotImplementedError

    def gemm(self, a, b, dims, out_dtype):
        raise NotImplementedError

    def state_inputs(self, operands: dict):
        """What the state update needs of the forward's operands (kept for the backward)."""
        return None

    def next_state(self, aux, operands: dict):
        return None


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizers(Quantizers):
    """NVFP4: operands and GEMM from the backend; SR keys folded per dY copy."""

    backend: NVFP4Backend = None  # type: ignore[assignment]

    def aux(self, key, meta):
        return key

    def quantize(self, x, spec, key):
        return self.backend.operand(x, spec, _sr_key(spec, key))

    def quantize_group(self, items, key):
        keys = _sr_keys_of([spec for spec, _ in items], key)
        return self.backend.group([(x, spec, k) for (spec, x), k in zip(items, keys)])

    def measure(self, x, spec, key):
        return health.nvfp4_spec_stats(x, spec, _sr_key(spec, key))

    def gemm(self, a, b, dims, out_dtype):
        return self.backend.gemm(a, b, dims, out_dtype)


@dataclasses.dataclass(frozen=True)
class MXFP4Quantizers(Quantizers):
    """MXFP4: E2M1 times a power of two, exact in bf16 (outside the far ends of the E8M0
    range); no per-tensor scale. The spec's 2-D tiles, RHT and SR are honoured as NVFP4's are,
    with the same per-copy SR keys (`mxfp4_nvfp4_recipe`)."""

    def aux(self, key, meta):
        return key

    def quantize(self, x, spec, key):
        return dequantize(quantize_mxfp4_spec(x, spec, _sr_key(spec, key)), jnp.bfloat16)

    def measure(self, x, spec, key):
        return health.mxfp4_spec_stats(x, spec, _sr_key(spec, key))

    def gemm(self, a, b, dims, out_dtype):
        return bf16_gemm(a, b, 1.0, dims, out_dtype)


@dataclasses.dataclass(frozen=True)
class FP8Quantizers(Quantizers):
    """Per-tensor FP8 (HYBRID: E4M3 X and W, E5M2 dY). An operand is (FP8 values, fp32 decode
    scale, amax); delayed scaling takes the scale from the history and returns the next one."""

    def aux(self, key, meta):
        return meta

    def _scale(self, role, amax, meta):
        if self.recipe.fp8_delayed:
            return meta[fp8_delayed.scale_name(role)][0]  # from earlier steps only
        return fp8_delayed.scale_from_amax(amax, fp8_delayed.ROLE_FORMATS[role])[0]

    def _quantize(self, x, spec, meta):
        amax = _amax(x)
        fmt = fp8_delayed.ROLE_FORMATS[spec.role]
        scale = self._scale(spec.role, amax, meta)
        return quantize_fp8(x, scale, fmt), scale, amax, fmt

    def quantize(self, x, spec, meta):
        q, _, amax, _ = self._quantize(x, spec, meta)
        return q.data, q.scale_inv, amax

    def measure(self, x, spec, meta):
        q, scale, _, fmt = self._quantize(x, spec, meta)
        return health.fp8_stats(x, q.data, scale, q.scale_inv, fmt)

    def gemm(self, a, b, dims, out_dtype):
        (a_data, a_decode, _), (b_data, b_decode, _) = a, b
        return bf16_gemm(a_data, b_data, a_decode * b_decode, dims, out_dtype)

    def state_inputs(self, operands):
        return operands if self.recipe.fp8_delayed else None

    def next_state(self, meta, operands):
        amaxes = {role: op[2] for role, op in operands.items()}
        return fp8_delayed.next_fp8_meta(meta, amaxes, margin=self.recipe.margin)


def _amax(x):
    # An integer max over |x| bits: XLA's float max can drop NaN.
    return F.bits_to_f32(jnp.max(F.abs_bits(x)))


_SR_FOLD = {"dy": SR_DGRAD, "dy_wgrad": SR_WGRAD}


def _sr_keys_of(specs, key) -> list:
    """`[_sr_key(spec, key) for spec in specs]`, bit for bit, both dY copies' keys from one
    `sr_keys` call when the group rounds both stochastically."""
    roles = {spec.role for spec in specs if spec.stochastic}
    if roles != set(_SR_FOLD):
        return [_sr_key(spec, key) for spec in specs]
    by_role = dict(zip(("dy", "dy_wgrad"), sr_keys(key)))
    return [by_role[spec.role] if spec.stochastic else None for spec in specs]


def _sr_key(spec: OperandSpec, key):
    """The stochastic-rounding key of one operand: the step's key folded with its dY copy's
    constant (`sr_keys`); None for an operand that rounds to nearest."""
    return jax.random.fold_in(key, _SR_FOLD[spec.role]) if spec.stochastic else None


def quantizers(recipe: Recipe, backend: NVFP4Backend = None) -> Quantizers:
    """The quantizer set of a quantized `recipe` (NVFP4 operands and GEMMs by `backend`)."""
    if recipe.format == "nvfp4":
        return NVFP4Quantizers(recipe, backend or EMULATED)
    if recipe.format == "mxfp4":
        return MXFP4Quantizers(recipe)
    if recipe.format == "fp8":
        return FP8Quantizers(recipe)
    raise ValueError(f"{recipe_name(recipe)} quantizes nothing: it has no quantizer set")
