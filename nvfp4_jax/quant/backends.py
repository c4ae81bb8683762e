"""Which code runs a recipe's quantized GEMMs: the `quantization_backend` choice.

| backend    | NVFP4 recipes                                     | FP8 / MXFP4 recipes            |
|------------|---------------------------------------------------|--------------------------------|
| `emulated` | `nvfp4_gemm_operand` + bf16 dot, fp32 accumulation | emulated                       |
| `xla`      | `xla_operand` + `jax.nn.scaled_matmul`            | not covered: an error          |
| `te`       | Transformer Engine (`make_dot_general_cls`)       | FP8 through TE; MXFP4 an error |
| `auto`     | `xla` where `scaled_matmul` compiles to cuDNN's FP4 GEMM (Blackwell), else `emulated` | `emulated` |

`auto` never picks `te`: TE's state tree differs for delayed-scaling FP8 and its FSDP runs are not
bit-identical to one-device runs, so TE is used only when asked for by name. `auto` does not pick
`xla` where XLA only rewrites `scaled_matmul` into dequantize-then-dot (Hopper and older): that
has no FP4 tensor cores and nothing to gain over the emulated GEMM.

One function, `resolve_backend`, turns the config's `quantization`, `quantization_backend` and
`quant_kernels` into the `Backend` a run uses: its name and reason (`choose_backend`), and the
executor that runs the dots: an `NVFP4Backend` (operand quantizer, paired-operand quantizer,
GEMM) or `te_backend.TE`, which replaces the whole dot. It is decided once at start-up, printed
once (`Backend.lines`), held by the model builder and passed down (`Backend.dot_general_factory`,
`Backend.scope`). `make_backend(name, operand=...)` pairs a backend's GEMM with any quantizer
that returns that GEMM's operand form (`(bf16 values, decode scale)` for emulated,
`BlockScaledOperand` for xla).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Union

import jax
import numpy as np
from jax.experimental import multihost_utils

from nvfp4_jax.quant import fp8_delayed, te_backend, xla_backend
from nvfp4_jax.quant.nvfp4_backend import EMULATED, NVFP4Backend, emulated_gemm
from nvfp4_jax.quant.flax_dot import dot_general_factory as _factory
from nvfp4_jax.quant.recipe import BACKENDS, Recipe, recipe_name, require_recipe
_AUTO_AND_TE = "auto never picks te (quantization_backend=te asks for Transformer Engine)"


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """The backend a run uses (`emulated`, `xla` or `te`) and why, in words."""

    name: str
    reason: str

    @property
    def line(self) -> str:
        """The start-up line."""
        return f"quantization backend: {self.name} ({self.reason})"


def choose_backend(
    requested: str,
    recipe: Recipe,
    *,
    probe: Optional[Callable[[], xla_backend.ScaledMatmulProbe]] = None,
    check_te: Optional[Callable[[Recipe], str]] = None,
    allow_xla_fallback: bool = False,
    gather: Optional[Callable[[int], Sequence[int]]] = None,
) -> BackendChoice:
    """Resolve `quantization_backend=requested` for `recipe` on this process's local devices,
    in agreement with every other process of the run.

    `probe` (default `xla_backend.probe_scaled_matmul`) compiles a tiny `scaled_matmul` on the
    first local device; `gather` (default `process_allgather_int`) shares its outcome across
    processes, and all of them then decide from the weakest outcome, so every process ends with
    the same backend. `check_te` (default `te_backend.check_te`) returns TE's version or raises.
    All three are parameters for tests. An explicit backend that cannot run here raises
    (ValueError, or TEUnavailableError for te) with the reason; `auto` always resolves.
    `allow_xla_fallback` accepts an explicit `xla` where XLA only rewrites `scaled_matmul` into
    dequantize-then-dot (no FP4 tensor cores: slower than emulated); without it that is an error.
    """
    if requested not in BACKENDS:
        raise ValueError(f"quantization_backend={requested!r}; choose one of {list(BACKENDS)}")
    recipe = require_recipe(recipe, "choose_backend")
    name = recipe_name(recipe)
    probe = probe or xla_backend.probe_scaled_matmul
    if recipe.is_bf16:
        return BackendChoice("emulated", f"quantization={name} quantizes nothing: every GEMM is lax.dot_general")
    if requested == "emulated":
        return BackendChoice("emulated", "asked for: pure-JAX numerics, bf16 GEMMs with fp32 accumulation")
    if requested == "te":
        version = (check_te or te_backend.check_te)(recipe)
        return BackendChoice("te", f"asked for: Transformer Engine {version} runs {name} here")
    if requested == "xla":
        if recipe.format != "nvfp4":
            raise ValueError(
                f"quantization_backend=xla runs NVFP4 recipes through jax.nn.scaled_matmul; "
                f"quantization={name} is {recipe.format}: use quantization_backend=auto or emulated"
            )
        result = agreed_probe(probe(), gather or process_allgather_int)
        if not result.lowers:
            raise ValueError(
                f"quantization_backend=xla: jax.nn.scaled_matmul {result.detail}; use "
                "quantization_backend=auto or emulated"
            )
        if not result.fused and not allow_xla_fallback:
            raise ValueError(
                f"quantization_backend=xla: jax.nn.scaled_matmul {result.detail}, slower than "
                "quantization_backend=emulated (same numerics); use emulated, or "
                "xla_dequantize_fallback=true to run the rewrite anyway"
            )
        return BackendChoice("xla", f"asked for: jax.nn.scaled_matmul {result.detail}")
    if recipe.format != "nvfp4":
        return BackendChoice("emulated", f"auto: {name} is {recipe.format}, the xla backend covers NVFP4 only; {_AUTO_AND_TE}")
    result = agreed_probe(probe(), gather or process_allgather_int)
    return BackendChoice("xla" if result.fused else "emulated",
                         f"auto: jax.nn.scaled_matmul {result.detail}; {_AUTO_AND_TE}")


# A probe's outcome as one int every process can share: the smallest is the weakest.
_ABSENT, _REWRITTEN, _FUSED = 0, 1, 2
_OUTCOME_WORDS = {_ABSENT: "does not lower", _REWRITTEN: "lowers only as dequantize-then-dot",
                  _FUSED: "reaches FP4 tensor cores"}


def _outcome(result: xla_backend.ScaledMatmulProbe) -> int:
    return _FUSED if result.fused else _REWRITTEN if result.lowers else _ABSENT


def process_allgather_int(value: int) -> list[int]:
    """`value` of every process of the run, by process index ([value] on one process)."""
    if jax.process_count() == 1:
        return [int(value)]
    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int32(value))).reshape(-1)]


def agreed_probe(result: xla_backend.ScaledMatmulProbe, gather: Callable[[int], Sequence[int]]):
    """This process's probe `result` if every process saw the same outcome, else the weakest
    outcome any process saw, naming the processes. Raises ValueError (one line) when the
    processes cannot exchange it."""
    try:
        outcomes = [int(v) for v in gather(_outcome(result))]
    except Exception as err:  # noqa: BLE001 - any failure means the processes cannot agree
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(
            f"quantization_backend: the processes could not agree on the backend "
            f"({type(err).__name__}: {first}); set quantization_backend=emulated on every process"
        ) from err
    worst = min(outcomes)
    if worst == _outcome(result) and len(set(outcomes)) == 1:
        return result
    where = [i for i, o in enumerate(outcomes) if o == worst]
    detail = (f"{_OUTCOME_WORDS[worst]} on process(es) {where} of {len(outcomes)}, so on none "
              f"(this process: {result.detail})")
    return xla_backend.ScaledMatmulProbe(worst >= _REWRITTEN, worst == _FUSED, detail)


def make_backend(
    name: str,
    *,
    operand: Optional[Callable] = None,
    scaled_matmul: Callable = jax.nn.scaled_matmul,
) -> Union[NVFP4Backend, te_backend.TEBackend]:
    """What `QuantDotGeneral(nvfp4_backend=...)` takes for backend `name`.

    `operand` replaces the backend's default quantizer (e.g. a Pallas kernel); it must return
    the backend's operand form. `scaled_matmul` is the xla backend's GEMM (tests pass
    `xla_backend.scaled_matmul_reference`).
    """
    if name == "emulated":
        return EMULATED if operand is None else NVFP4Backend("emulated", operand, emulated_gemm)
    if name == "xla":
        gemm = xla_backend.ScaledMatmulGemm(scaled_matmul)
        if operand is not None:  # the caller's quantizer, each operand on its own
            return NVFP4Backend("xla", operand, gemm)
        return NVFP4Backend("xla", xla_backend.block_scaled_operand, gemm,
                            operand_group=xla_backend.block_scaled_operand_group)
    if name == "te":
        if operand is not None:
            raise ValueError("quantization_backend=te: Transformer Engine quantizes its own operands")
        return te_backend.TE
    raise ValueError(f"no backend {name!r}; make_backend takes one of {list(BACKENDS[1:])}")


@dataclasses.dataclass(frozen=True)
class Backend:
    """What start-up resolved from the config: which backend runs the quantized dots and why,
    and the executor that does it (an `NVFP4Backend` or `te_backend.TE`, which replaces the whole
    dot). `operands` says who quantizes NVFP4 operands (None when no NVFP4 recipe runs)."""

    name: str
    reason: str
    executor: Union[NVFP4Backend, te_backend.TEBackend] = EMULATED
    operands: Optional[str] = None

    @property
    def line(self) -> str:
        """The start-up line."""
        return f"quantization backend: {self.name} ({self.reason})"

    def dot_general_factory(self, recipe: Recipe, *, quant_stats: bool = False,
                            kernel_dtype: Optional[str] = None):
        """The model's factory of quantized dots for `recipe` on this backend (None for bf16)."""
        return _factory(recipe, self.executor, quant_stats=quant_stats, kernel_dtype=kernel_dtype)

    def scope(self, batch_axes: tuple[str, str]):
        """What tracing and compiling a model on this backend needs around it, on a mesh whose
        batch is split over the mesh axes `batch_axes` (`sharding.BATCH_AXES`)."""
        return self.executor.scope(batch_axes)


def resolve_backend(
    requested: str,
    recipe: Recipe,
    quant_kernels: str = "jnp",
    *,
    probe: Optional[Callable[[], xla_backend.ScaledMatmulProbe]] = None,
    check_te: Optional[Callable[[Recipe], str]] = None,
    allow_xla_fallback: bool = False,
    gather: Optional[Callable[[int], Sequence[int]]] = None,
    attach_kernels: Optional[Callable[[NVFP4Backend, str], tuple[NVFP4Backend, str]]] = None,
) -> Backend:
    """The backend of `quantization_backend=requested`, `quantization=recipe` and
    `quant_kernels` on this process's devices: the one decision about how the GEMMs run.

    `attach_kernels(executor, quant_kernels)` returns the emulated executor with its operands
    computed as `quant_kernels` says, and who computes them (the caller passes the kernels'
    selection, which sits above this package); without it only quant_kernels=jnp is possible.
    Raises as `choose_backend` does for a backend that cannot run here.
    """
    recipe = require_recipe(recipe, "resolve_backend")
    choice = choose_backend(requested, recipe, probe=probe, check_te=check_te,
                            allow_xla_fallback=allow_xla_fallback, gather=gather)
    executor = make_backend(choice.name)
    if recipe.format != "nvfp4":
        return Backend(choice.name, choice.reason, executor)
    if choice.name != "emulated":
        if quant_kernels == "pallas":
            raise ValueError(
                f"quant_kernels=pallas: the {choice.name} backend quantizes its own operands "
                "(the kernels feed only the emulated GEMM); use quant_kernels=auto or jnp, or "
                "quantization_backend=emulated"
            )
        return Backend(choice.name, choice.reason, executor,
                       f"jnp (the {choice.name} backend quantizes its own operands)")
    if attach_kernels is None:
        if quant_kernels != "jnp":
            raise ValueError(f"quant_kernels={quant_kernels}: resolve_backend was given no attach_kernels")
        return Backend(choice.name, choice.reason, executor, "jnp (quant_kernels=jnp)")
    executor, operands = attach_kernels(executor, quant_kernels)
    return Backend(choice.name, choice.reason, executor, operands)


def _state_collection(recipe: Recipe, backend: str) -> Optional[str]:
    """The collection holding the recipe's train-state variables under `backend` (None: none)."""
    if not recipe.fp8_delayed:
        return None
    return te_backend.TE_STATE_COLLECTION if backend == "te" else fp8_delayed.COLLECTION


def check_backend_resume(saved: Optional[str], now: str, recipe: Recipe) -> None:
    """Raise ValueError when a checkpoint written under backend `saved` cannot be resumed under
    `now`: the backends keep the recipe's state in different collections. Between emulated and
    xla, and for every recipe but te_fp8_delayedscaling, the trees agree and resuming works."""
    recipe = require_recipe(recipe, "check_backend_resume")
    if saved is None or saved == now:
        return
    if _state_collection(recipe, saved) != _state_collection(recipe, now):
        raise ValueError(
            f"The checkpoint was written with quantization_backend={saved} and this run uses {now}: "
            f"for quantization={recipe_name(recipe)} they keep the FP8 amax histories in different "
            f"collections ({_state_collection(recipe, saved)!r} vs {_state_collection(recipe, now)!r}), "
            f"so the state cannot be restored. Resume with quantization_backend={saved}."
        )
