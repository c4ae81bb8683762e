"""The Flax form of the quantization seam: `QuantDotGeneral`, a module with dot_general's call.

A model is handed a zero-argument factory (`dot_general_factory(recipe)`) and calls it once per
projection inside its compact body, so each projection owns one `QuantDotGeneral` submodule.
That submodule

- draws its stochastic-rounding key from the rng stream "quant" (`self.make_rng("quant")`), so
  keys differ per layer (Flax folds in the module path) and per step (the key the train step
  passes in `rngs`);
- for delayed-scaling FP8 keeps its amax histories and scales in the variable collection
  "fp8_meta", updated by the overwrite-with-gradient rule (see `fp8_delayed`);
- with `quant_stats=True`, keeps a zero statistics pytree per operand in the collection
  "quant_stats" whose gradient is what quantizing each operand did (see `health`). Only a
  dedicated statistics step builds such modules; the train step never does.

What the train step does (see `nvfp4_jax.train.step`):

    def loss_fn(params, fp8_meta):
        variables = {"params": params, "fp8_meta": fp8_meta}
        return loss(model.apply(variables, x, rngs=quant_rngs(step_key)))
    loss, (grads, new_fp8_meta) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fp8_meta)
    # optimizer sees `grads` only; the state becomes new_fp8_meta as is.

The "gradient" of fp8_meta is only the next state when it comes from exactly one backward
pass through each layer: with gradient accumulation keep the last micro-batch's, never a sum.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from nvfp4_jax.quant import fp8_delayed, health, te_backend
from nvfp4_jax.quant.dot import make_dot_general
from nvfp4_jax.quant.nvfp4_backend import EMULATED, NVFP4Backend
from nvfp4_jax.quant.recipe import Recipe, recipe_name, require_recipe

RNG_STREAM = "quant"
# Collections whose "gradient" is the next value (ours, and TE's for its DelayedScaling).
OVERWRITE_WITH_GRADIENT_COLLECTIONS = (fp8_delayed.COLLECTION, te_backend.TE_STATE_COLLECTION)


class QuantDotGeneral(nn.Module):
    """A `lax.dot_general`-compatible Flax module that runs `recipe`'s quantized GEMMs.

    Attributes:
      recipe: the `Recipe` (a flag string is resolved once, by the caller: `get_recipe`).
      nvfp4_backend: how NVFP4 operands are quantized and GEMMs run (`nvfp4_backend.NVFP4Backend`,
        ignored by the other formats), or `te_backend.TE`: Transformer Engine runs the whole
        quantized GEMM of the recipe (NVFP4 or FP8). `backends.make_backend(name)` gives either.
      quant_stats: measure every quantized operand (variables in `health.COLLECTION`, whose
        gradient is the statistics). Not with Transformer Engine, whose kernels keep their
        operands to themselves.
    """

    recipe: Recipe
    nvfp4_backend: Union[NVFP4Backend, te_backend.TEBackend] = EMULATED
    quant_stats: bool = False
    # Quantize the kernel from this dtype (e.g. "bfloat16", as MaxText + TE do); None: as given.
    kernel_dtype: Optional[str] = None

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        recipe = require_recipe(self.recipe, "QuantDotGeneral")
        if recipe.is_bf16:
            return lax.dot_general(
                lhs, rhs, dimension_numbers, precision=precision,
                preferred_element_type=preferred_element_type,
            )
        if self.nvfp4_backend.replaces_dot:
            if self.quant_stats:
                raise ValueError(
                    f"QuantDotGeneral({recipe_name(recipe)}): quant_stats=true needs "
                    "quantization_backend=emulated or xla; Transformer Engine's kernels do not "
                    "expose their operands"
                )
            return self._te(recipe, lhs, rhs, dimension_numbers, precision, preferred_element_type)
        key = self._sr_key(recipe) if recipe.needs_rng else None
        meta = self._fp8_meta(recipe) if recipe.fp8_delayed else None
        stats = self._stats(recipe) if self.quant_stats else None
        dot_general = make_dot_general(
            recipe, key, fp8_meta=meta, backend=self.nvfp4_backend, quant_stats=stats,
            kernel_dtype=self.kernel_dtype,
        )
        return dot_general(
            lhs, rhs, dimension_numbers, precision=precision,
            preferred_element_type=preferred_element_type,
        )

    def _te(self, recipe, lhs, rhs, dimension_numbers, precision, preferred_element_type):
        te_dot = te_backend.te_dot_general_cls(recipe)(name="te")
        if self.kernel_dtype is not None:
            rhs = rhs.astype(self.kernel_dtype)  # TE quantizes it; its bf16 dW is cast back
        y = te_dot(lhs, rhs, dimension_numbers, precision=precision)
        # TE returns its GEMM's own output dtype (bf16 for NVFP4) and ignores the request.
        out_dtype = jnp.result_type(lhs, rhs) if preferred_element_type is None else preferred_element_type
        return y.astype(out_dtype)

    def _sr_key(self, recipe: Recipe) -> jax.Array:
        if self.has_rng(RNG_STREAM):
            return self.make_rng(RNG_STREAM)
        if self.is_initializing():
            # init only needs shapes; its gradients are never rounded.
            return jax.random.PRNGKey(0)
        raise ValueError(
            f"QuantDotGeneral({recipe_name(recipe)}) rounds gradients stochastically and needs "
            f"the rng stream {RNG_STREAM!r}: model.apply(..., rngs={{{RNG_STREAM!r}: key}}) "
            "with a different key every step"
        )

    def _fp8_meta(self, recipe: Recipe) -> fp8_delayed.FP8Meta:
        length = recipe.amax_history_len
        meta = {}
        for role in fp8_delayed.ROLES:
            h = fp8_delayed.history_name(role)
            s = fp8_delayed.scale_name(role)
            meta[h] = self.variable(fp8_delayed.COLLECTION, h, jnp.zeros, (length,), jnp.float32).value
            meta[s] = self.variable(fp8_delayed.COLLECTION, s, jnp.ones, (1,), jnp.float32).value
        return meta

    def _stats(self, recipe: Recipe) -> dict:
        zeros = health.init_stats(recipe)
        return {op: self.variable(health.COLLECTION, op, lambda z=z: z).value for op, z in zeros.items()}


@dataclasses.dataclass(frozen=True)
class DotFactory:
    """A zero-argument factory of `QuantDotGeneral(recipe, nvfp4_backend, quant_stats)`: what a
    model is handed, and what tracing it needs around it (`scope`)."""

    recipe: Recipe
    nvfp4_backend: Union[NVFP4Backend, te_backend.TEBackend] = EMULATED
    quant_stats: bool = False
    kernel_dtype: Optional[str] = None

    def __call__(self, **kwargs) -> QuantDotGeneral:
        return QuantDotGeneral(recipe=self.recipe, nvfp4_backend=self.nvfp4_backend,
                               quant_stats=self.quant_stats, kernel_dtype=self.kernel_dtype, **kwargs)

    def scope(self, batch_axes: tuple[str, str]):
        """The backend's context for tracing and compiling (TE's MeshResource; else none)."""
        return self.nvfp4_backend.scope(batch_axes)


def dot_general_factory(
    recipe: Recipe,
    nvfp4_backend: Union[NVFP4Backend, te_backend.TEBackend] = EMULATED,
    *,
    quant_stats: bool = False,
    kernel_dtype: Optional[str] = None,
) -> Optional[DotFactory]:
    """A zero-argument factory of `QuantDotGeneral(recipe, nvfp4_backend, quant_stats)`, or None
    for bf16.

    None means "use `jax.lax.dot_general`", the model's convention for BF16.
    """
    recipe = require_recipe(recipe, "dot_general_factory")
    if recipe.is_bf16:
        return None
    return DotFactory(recipe, nvfp4_backend, quant_stats, kernel_dtype)


def quant_rngs(key: jax.Array) -> dict:
    """The `rngs` for `model.apply` of one step: our stream "quant" and TE's "sr_rng"."""
    return {RNG_STREAM: key, te_backend.TE_RNG_STREAM: jax.random.fold_in(key, 0x7E)}
