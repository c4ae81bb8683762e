"""The Transformer Engine backend (`quantization_backend=te`), imported only when asked for.

TE's JAX package (`transformer_engine.jax`) runs NVFP4 GEMMs on Blackwell (compute capability
10.x). We use its public Flax helper `transformer_engine.jax.flax.make_dot_general_cls(recipe)`
(TE >= 2.12), which returns a Flax module class with `lax.dot_general`'s call signature, built
from one of TE's recipe objects (`transformer_engine.common.recipe`). Facts about TE's side
that the train step must know:

- `NVFP4BlockScaling` draws its stochastic-rounding key from the Flax rng stream "sr_rng"
  (ours is "quant"); `nvfp4_jax.quant.flax_dot.quant_rngs` gives both streams.
- `DelayedScaling` keeps its amax histories in the collection "_overwrite_with_gradient",
  updated by the same overwrite-with-gradient rule as our "fp8_meta" (so a te_fp8_delayedscaling
  state tree differs between TE and the other backends).
- TE's custom partitioning reads a global `MeshResource` at trace and compile time: without one
  a 2+ device compile asserts "Global mesh resource is not set", and without `fsdp_resource` the
  amax is not reduced over FSDP shards. `mesh_resource_scope` sets it (MaxText sets the same
  around its whole run); `train/build.py` enters it around init, train and eval when the
  backend is te.
- TE reduces the NVFP4 activation amax over the mesh axes it is told about, inside its own
  kernels: a TE run under FSDP is not bit-identical to a one-GPU run (ours and the xla backend's
  are, see docs/backends.md); compare TE runs within a tolerance.

Nothing else in nvfp4_jax imports TE. This file cannot run here (no GPU, no TE); its tests run
it against a fake TE module with TE's public names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from typing import Any, ClassVar

import jax

from nvfp4_jax.quant.recipe import Recipe, recipe_name

TE_RNG_STREAM = "sr_rng"
TE_STATE_COLLECTION = "_overwrite_with_gradient"
# The first TE release with transformer_engine.jax.flax.make_dot_general_cls.
TE_MIN_VERSION = "2.12"

_INSTALL_HINT = (
    "Transformer Engine's JAX package (`transformer_engine.jax`) is not importable here. "
    "quantization_backend=te needs it and an NVIDIA Blackwell GPU (compute capability 10.x). Use "
    "the GPU container in docker/ (it ships TE), or install it with "
    "`pip install --no-build-isolation transformer_engine[jax]` on a CUDA machine; "
    "quantization_backend=emulated runs the same numerics in pure JAX on any device, and "
    "quantization_backend=xla reaches FP4 tensor cores through jax.nn.scaled_matmul without TE."
)


class TEUnavailableError(ImportError):
    """quantization_backend=te was asked for but Transformer Engine cannot run it here."""


@dataclasses.dataclass(frozen=True)
class TEBackend:
    """The marker `QuantDotGeneral(nvfp4_backend=TE)` routes to TE: TE runs the whole quantized
    GEMM (quantizers, three GEMMs, state) of any recipe it has (NVFP4 and FP8)."""

    name: str = "te"
    replaces_dot: ClassVar[bool] = True

    def scope(self, batch_axes: tuple[str, str]):
        """TE's MeshResource for our mesh, whose batch is split over the mesh axes `batch_axes`
        (data, fsdp: `sharding.BATCH_AXES`); TE's partitioning reads it while tracing."""
        data, fsdp = batch_axes
        return mesh_resource_scope(dp_axis=data, fsdp_axis=fsdp)


TE = TEBackend()


@functools.lru_cache(maxsize=None)
def _import_te():
    """`{name: module}` of the TE modules we use, or the exception importing them raised."""
    names = {
        "root": "transformer_engine",
        "te": "transformer_engine.jax",
        "flax": "transformer_engine.jax.flax",
        "recipe": "transformer_engine.common.recipe",
        "quantize": "transformer_engine.jax.quantize",
        "sharding": "transformer_engine.jax.sharding",
    }
    try:
        return {k: importlib.import_module(v) for k, v in names.items()}
    except Exception as err:  # TE raises more than ImportError when CUDA libraries are missing.
        return err


def te_available() -> bool:
    """True when `transformer_engine.jax` imports."""
    return not isinstance(_import_te(), Exception)


def require_te() -> dict:
    """The TE modules (`{"root", "te", "flax", "recipe", "quantize", "sharding"}`), or
    TEUnavailableError saying how to get them."""
    mods = _import_te()
    if isinstance(mods, Exception):
        raise TEUnavailableError(f"{_INSTALL_HINT} (import failed with: {mods!r})") from mods
    return mods


def te_version() -> str:
    """The installed `transformer_engine` version ("unknown" if it does not say)."""
    return str(getattr(require_te()["root"], "__version__", "unknown"))


def device_is_blackwell(devices=None) -> bool:
    """True when the first accelerator reports CUDA compute capability 10.x."""
    devices = jax.devices() if devices is None else devices
    for dev in devices:
        cc = getattr(dev, "compute_capability", None)
        if dev.platform == "gpu" and cc is not None:
            return str(cc).split(".")[0] == "10"
    return False


# Fields of TE's recipe classes that default to an environment variable and change the numerics
# (TE 2.20: 4-over-6 block scaling, row-scaled activations, a high-precision or dequantized
# backward): pinned to the standard recipe wherever the installed TE has them, so that an
# NVTE_* variable in the user's shell cannot make TE's GEMMs differ from ours.
_TE_PINNED = {"row_scaled_activation": False, "nvfp4_4over6": "none", "backward_override": None}


def _te_recipe_object(cls, **fields) -> Any:
    """`cls(**fields)`, with every `_TE_PINNED` field the installed TE's class has pinned."""
    have = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return cls(**fields, **{k: v for k, v in _TE_PINNED.items() if k in have and k not in fields})


def te_recipe(recipe: Recipe) -> Any:
    """The `transformer_engine.common.recipe` object with our recipe's numerics."""
    r = require_te()["recipe"]
    if recipe.format == "nvfp4":
        return _te_recipe_object(
            r.NVFP4BlockScaling,
            disable_rht=not recipe.rht_wgrad,
            disable_stochastic_rounding=not recipe.sr_gradients,
            disable_2d_quantization=not recipe.two_d_weights,
        )
    if recipe.format == "fp8" and recipe.fp8_scaling == "delayed":
        return _te_recipe_object(
            r.DelayedScaling,
            margin=recipe.margin,
            fp8_format=r.Format.HYBRID,
            amax_history_len=recipe.amax_history_len,
            amax_compute_algo="max",
        )
    if recipe.format == "fp8":
        return _te_recipe_object(r.Float8CurrentScaling, fp8_format=r.Format.HYBRID)
    raise ValueError(
        f"quantization_backend=te has no Transformer Engine recipe for {recipe_name(recipe)} "
        f"(format={recipe.format!r}); use quantization_backend=emulated"
    )


def check_te(recipe: Recipe) -> str:
    """TE's version, or raise saying why TE cannot run `recipe` on this machine's devices.

    TEUnavailableError: TE does not import, is older than 2.12, or its own support test
    (`get_quantize_config_with_recipe(recipe).is_supported()`) fails on the local GPUs.
    ValueError: TE has no recipe for this format (MXFP4).
    """
    mods = require_te()
    recipe_obj = te_recipe(recipe)
    if not hasattr(mods["flax"], "make_dot_general_cls"):
        raise TEUnavailableError(
            f"Transformer Engine {te_version()} lacks transformer_engine.jax.flax."
            f"make_dot_general_cls (added in TE {TE_MIN_VERSION}); upgrade TE (the container in "
            "docker/ has a recent one) or use quantization_backend=xla or emulated"
        )
    supported, reason = mods["quantize"].get_quantize_config_with_recipe(recipe_obj).is_supported()
    if not supported:
        raise TEUnavailableError(
            f"Transformer Engine {te_version()} cannot run {recipe_name(recipe)} on these devices: "
            f"{reason} (NVFP4 needs compute capability 10.x); use quantization_backend=xla or emulated"
        )
    return te_version()


def te_unavailable_reason(recipe: Recipe) -> str | None:
    """Why TE cannot run `recipe` here, in one line; None when it can."""
    try:
        check_te(recipe)
    except (TEUnavailableError, ValueError) as err:
        return str(err)
    return None


def te_dot_general_cls(recipe: Recipe):
    """TE's Flax dot_general module class for `recipe` (call it with lax.dot_general's arguments)."""
    check_te(recipe)
    return require_te()["flax"].make_dot_general_cls(te_recipe(recipe))


@contextlib.contextmanager
def mesh_resource_scope(*, dp_axis: str, fsdp_axis: str):
    """TE's global MeshResource for our ("data", "fsdp") mesh, for the duration of the block.

    Enter it around everything that traces or compiles a model with TE dots (init, train and
    eval steps): TE's custom partitioning reads it then.
    """
    sharding = require_te()["sharding"]
    with sharding.global_shard_guard(sharding.MeshResource(dp_resource=dp_axis, fsdp_resource=fsdp_axis)):
        yield
