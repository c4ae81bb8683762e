"""The Transformer Engine backend, imported only when asked for.

TE's JAX package (`transformer_engine.jax`) runs NVFP4 GEMMs on Blackwell (compute capability
10.x). We use its public Flax helper `transformer_engine.jax.flax.make_dot_general_cls(recipe)`,
which returns a Flax module class with `lax.dot_general`'s call signature, built from one of
TE's recipe objects (`transformer_engine.common.recipe`). Facts about TE's side that the train
step must know:

- `NVFP4BlockScaling` draws its stochastic-rounding key from the Flax rng stream "sr_rng"
  (ours is "quant"); `nvfp4_jax.quant.flax_dot.quant_rngs` gives both streams.
- `DelayedScaling` keeps its amax histories in the collection "_overwrite_with_gradient",
  updated by the same overwrite-with-gradient rule as our "fp8_meta".

Nothing else in nvfp4_jax imports TE. This file cannot run here (no GPU); its tests cover the
selection logic and the error messages.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import jax

from nvfp4_jax.quant.recipe import Recipe, recipe_name

TE_RNG_STREAM = "sr_rng"
TE_STATE_COLLECTION = "_overwrite_with_gradient"

_INSTALL_HINT = (
    "Transformer Engine's JAX package (`transformer_engine.jax`) is not importable here. "
    "backend='te' needs it and an NVIDIA Blackwell GPU (compute capability 10.x). Use the GPU "
    "container in docker/ (it ships TE), or install it with "
    "`pip install --no-build-isolation transformer_engine[jax]` on a CUDA machine; "
    "backend='emulated' runs the same numerics in pure JAX on any device."
)


class TEUnavailableError(ImportError):
    """backend='te' was asked for but Transformer Engine's JAX package does not import."""


@functools.lru_cache(maxsize=None)
def _import_te():
    """(transformer_engine.jax, its flax submodule, its recipe module), or the ImportError."""
    try:
        te = importlib.import_module("transformer_engine.jax")
        te_flax = importlib.import_module("transformer_engine.jax.flax")
        te_recipe = importlib.import_module("transformer_engine.common.recipe")
    except Exception as err:  # TE raises more than ImportError when CUDA libraries are missing.
        return err
    return te, te_flax, te_recipe


def te_available() -> bool:
    """True when `transformer_engine.jax` imports."""
    return not isinstance(_import_te(), Exception)


def _unavailable_message() -> str:
    mods = _import_te()
    detail = f" (import failed with: {mods!r})" if isinstance(mods, Exception) else ""
    return _INSTALL_HINT + detail


def require_te():
    """`(te, te_flax, te_recipe)` modules, or TEUnavailableError saying how to get them."""
    mods = _import_te()
    if isinstance(mods, Exception):
        raise TEUnavailableError(_unavailable_message()) from mods
    return mods


def device_is_blackwell(devices=None) -> bool:
    """True when the first accelerator reports CUDA compute capability 10.x."""
    devices = jax.devices() if devices is None else devices
    for dev in devices:
        cc = getattr(dev, "compute_capability", None)
        if dev.platform == "gpu" and cc is not None:
            return str(cc).split(".")[0] == "10"
    return False


def te_supports(recipe: Recipe) -> bool:
    """TE has recipes for NVFP4 (with its ablation switches) and per-tensor FP8, not MXFP4."""
    return recipe.format in ("nvfp4", "fp8")


def resolve_backend(recipe: Recipe, *, te_ok=None, blackwell=None) -> str:
    """The backend that will run `recipe`: "emulated" or "te".

    "auto" picks TE only when TE imports, the GPU is compute capability 10.x and TE has the
    recipe; otherwise emulation. "te" raises TEUnavailableError without TE and ValueError for a
    recipe TE lacks. `te_ok` and `blackwell` override the probes (for tests).
    """
    if recipe.is_bf16 or recipe.backend == "emulated":
        return "emulated"
    if recipe.backend == "te":
        if not (te_available() if te_ok is None else te_ok):
            raise TEUnavailableError(_unavailable_message())
        if not te_supports(recipe):
            raise ValueError(
                f"backend='te' has no Transformer Engine recipe for {recipe_name(recipe)} "
                f"(format={recipe.format!r}); use backend='emulated'"
            )
        return "te"
    te_ok = te_available() if te_ok is None else te_ok
    blackwell = device_is_blackwell() if blackwell is None else blackwell
    return "te" if (te_ok and blackwell and te_supports(recipe)) else "emulated"


def te_recipe(recipe: Recipe) -> Any:
    """The `transformer_engine.common.recipe` object with our recipe's numerics."""
    _, _, r = require_te()
    if recipe.format == "nvfp4":
        return r.NVFP4BlockScaling(
            disable_rht=not recipe.rht_wgrad,
            disable_stochastic_rounding=not recipe.sr_gradients,
            disable_2d_quantization=not recipe.two_d_weights,
        )
    if recipe.format == "fp8" and recipe.fp8_scaling == "delayed":
        return r.DelayedScaling(
            margin=recipe.margin,
            fp8_format=r.Format.HYBRID,
            amax_history_len=recipe.amax_history_len,
            amax_compute_algo="max",
        )
    if recipe.format == "fp8":
        return r.Float8CurrentScaling(fp8_format=r.Format.HYBRID)
    raise ValueError(f"no Transformer Engine recipe for {recipe_name(recipe)}")


def te_dot_general_cls(recipe: Recipe):
    """TE's Flax dot_general module class for `recipe` (call it with lax.dot_general's arguments)."""
    _, te_flax, _ = require_te()
    return te_flax.make_dot_general_cls(te_recipe(recipe))
