"""From config to objects: the model with its recipe's dots, and a sharded initial state.

Init goes `eval_shape -> shardings -> jit(init, out_shardings=...)`, so no device ever holds
more than its shard of the model or optimizer state.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from nvfp4_jax import quant, sharding
from nvfp4_jax.config import ConfigError, ModelConfig
from nvfp4_jax.kernels import select as kernel_select
from nvfp4_jax.model import VLM, Llama, select_attention
from nvfp4_jax.quant import health
from nvfp4_jax.train.state import TrainState
from nvfp4_jax.train.step import make_eval_step, make_quant_stats_step, make_train_step

# The model each `model_type` builds (config.choices.MODEL_TYPES).
MODEL_CLASSES = {"llama": Llama, "vlm": VLM}


def quantization_backend(model_cfg: ModelConfig) -> quant.Backend:
    """The backend of the MLP GEMMs (`quantization_backend`, `quant_kernels`) resolved on this
    process's devices, once, at start-up (it may compile a tiny probe and run the kernels'
    self-check). A backend that cannot run here is a ConfigError."""
    try:
        return quant.resolve_backend(
            model_cfg.quantization_backend, model_cfg.mlp_recipe, model_cfg.quant_kernels,
            allow_xla_fallback=model_cfg.xla_dequantize_fallback, attach_kernels=_attach_kernels,
        )
    except (ValueError, ImportError) as err:
        raise ConfigError(str(err)) from err


def _attach_kernels(executor: quant.NVFP4Backend, choice: str) -> tuple[quant.NVFP4Backend, str]:
    """The emulated `executor` with the operand quantizer of `quant_kernels=choice`, and who
    that is and why (the start-up line)."""
    kernels = kernel_select.operand_kernels(choice)
    return kernel_select.with_operand_kernels(executor, kernels), f"{kernels.name} ({kernels.reason})"


def quant_kernels_line(model_cfg: ModelConfig, backend: quant.Backend) -> str | None:
    """The start-up line saying who quantizes NVFP4 operands and why (None without NVFP4)."""
    del model_cfg  # decided with the backend
    return None if backend.operands is None else f"NVFP4 operands: {backend.operands}"


def build_model(
    model_cfg: ModelConfig,
    *,
    quantized: bool = True,
    backend: quant.Backend | None = None,
    quant_stats: bool = False,
    attention_kernel: str | None = None,
) -> Llama | VLM:
    """The model of `model_cfg` (`model_type`: the Llama, or the VLM around it); `quantized=False`
    gives the same parameters with BF16 dots.

    `backend` (default: `quantization_backend(model_cfg)`) runs the MLP GEMMs, with operands
    by `quant_kernels` where it can use them. The attention kernel is selected here too,
    before anything is traced (`describe_attention` says which and why) unless `attention_kernel`
    names the one start-up chose (`assembly.Startup`). `quant_stats=True`
    gives the model of the quantization-statistics step (its dots measure their operands, see
    `quant.health`); never the one that trains.
    """
    mlp_dot = attention_dot = vision_dot = None
    if quantized:
        backend = backend or quantization_backend(model_cfg)
        # MaxText casts the fp32 kernel to the compute dtype before its dot and TE quantizes that
        # copy; quantize_fp32_kernel=true quantizes the master kernel instead.
        kernel_dtype = None if model_cfg.quantize_fp32_kernel else model_cfg.dtype
        mlp_dot = backend.dot_general_factory(
            model_cfg.mlp_recipe, quant_stats=quant_stats, kernel_dtype=kernel_dtype
        )
        # attention_quantization=fp8: stateless FP8 on the emulated executor, whatever the MLPs' backend
        attention_dot = quant.dot_general_factory(
            model_cfg.attention_recipe, quant_stats=quant_stats, kernel_dtype=kernel_dtype
        )
        if model_cfg.model_type == "vlm":  # the vision tower's MLPs, on the same backend
            vision_dot = backend.dot_general_factory(
                model_cfg.vision_recipe, quant_stats=quant_stats, kernel_dtype=kernel_dtype
            )
    kernel = attention_kernel or select_attention(model_cfg.attention, seq_len=model_cfg.max_target_length).kernel
    platform = jax.devices()[0].platform
    if kernel == "cudnn_flash" and platform != "gpu":
        raise ValueError(
            f"attention={model_cfg.attention} runs only on NVIDIA GPUs (cuDNN) and this run's "
            f"devices are {platform}: use attention=autoselected or attention=dot_product"
        )
    dots = {"vision_dot_general_cls": vision_dot} if model_cfg.model_type == "vlm" else {}
    return MODEL_CLASSES[model_cfg.model_type](model_cfg, mlp_dot_general_cls=mlp_dot,
                                               attention_dot_general_cls=attention_dot,
                                               attention_kernel=kernel, **dots)


def describe_attention(model_cfg: ModelConfig) -> str:
    """The start-up line: which attention kernel this run uses, and why."""
    kernel, reason = select_attention(model_cfg.attention, seq_len=model_cfg.max_target_length)
    return f"attention: {kernel} ({reason})"


def context_attention_warning(model_cfg: ModelConfig, context_ways: int) -> str | None:
    """A warning when the attention kernel and the context-parallel strategy work against each
    other: under `all_gather` the chunked kernel's block loops are left to XLA's partitioner,
    which runs them over the whole sequence on every device (benchmarks/results/context.json:
    the step time grows with the context ways instead of shrinking). Ulysses shards them."""
    kernel, _ = select_attention(model_cfg.attention, seq_len=model_cfg.max_target_length)
    if context_ways > 1 and kernel == "chunked" and model_cfg.context_parallel_strategy == "all_gather":
        return (f"warning: attention=chunked under context_parallel_strategy=all_gather with "
                f"ici_context_parallelism={context_ways}: every device computes the whole sequence's "
                "attention (XLA partitions the block loops that way); context_parallel_strategy=ulysses "
                "splits it by heads instead.")
    return None


def _init_variables(model: nn.Module, seq_len: int, params_key, quant_key) -> dict:
    """`model.init` on one row of `seq_len` tokens: every variable collection, boxed."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    # Every stream a quantized dot may draw from at init (TE's NVFP4 asks for "sr_rng" there).
    return model.init({"params": params_key, **quant.quant_rngs(quant_key)}, tokens)


def _init_boxed(model: nn.Module, optimizer: optax.GradientTransformation, seq_len: int, key):
    params_key, quant_key, run_key = jax.random.split(key, 3)
    variables = _init_variables(model, seq_len, params_key, quant_key)
    params = variables["params"]
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        fp8_meta={c: variables[c] for c in quant.OVERWRITE_WITH_GRADIENT_COLLECTIONS if c in variables},
        rng=run_key,
    )


def backend_scope(model: Llama):
    """What tracing and compiling `model` needs around it: TE's MeshResource when its MLP runs
    on Transformer Engine (TE's partitioning reads it), nothing otherwise."""
    factory = model.mlp_dot_general_cls or getattr(model, "vision_dot_general_cls", None)
    return contextlib.nullcontext() if factory is None else factory.scope(sharding.BATCH_AXES)


def _in_scope(model: Llama, step):
    """`step` (a `sharded_jit` callable) and its `.lower`, called under `backend_scope(model)`."""
    return sharding.within(lambda: backend_scope(model), step)


def state_shardings(model, optimizer, seq_len: int, mesh: Mesh):
    """(abstract unboxed state with shardings, sharding pytree), without allocating anything."""
    with backend_scope(model):
        boxed = jax.eval_shape(lambda k: _init_boxed(model, optimizer, seq_len, k), jax.random.PRNGKey(0))
    specs = nn.get_partition_spec(boxed)
    shardings = sharding.logical_to_sharding(specs, mesh)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.meta.unbox(boxed), shardings
    )
    return abstract, shardings


def init_state(model, optimizer, seq_len: int, mesh: Mesh, seed: int):
    """A freshly initialised, sharded TrainState and its shardings."""
    _, shardings = state_shardings(model, optimizer, seq_len, mesh)
    return init_sharded(model, optimizer, seq_len, shardings, seed), shardings


def init_sharded(model, optimizer, seq_len: int, shardings, seed: int):
    """A freshly initialised TrainState, each leaf created where `shardings` puts it."""
    init = jax.jit(
        lambda k: nn.meta.unbox(_init_boxed(model, optimizer, seq_len, k)), out_shardings=shardings
    )
    with backend_scope(model):
        return init(jax.random.PRNGKey(seed))


def jit_train_step(model, optimizer, mesh: Mesh, state_sh, *, uses_fp8_meta: bool = True,
                   adapters_only: bool = False):
    """The train step, jitted with explicit shardings and donated state, traced on `mesh`."""
    return _in_scope(model, sharding.sharded_jit(
        make_train_step(model, optimizer, uses_fp8_meta=uses_fp8_meta, adapters_only=adapters_only),
        mesh,
        in_shardings=(state_sh, sharding.batch_sharding(mesh)),
        out_shardings=(state_sh, sharding.replicated(mesh)),
        donate_argnums=0,
    ))


def jit_eval_step(model, mesh: Mesh, state_sh):
    return _in_scope(model, sharding.sharded_jit(
        make_eval_step(model),
        mesh,
        in_shardings=(state_sh, sharding.batch_sharding(mesh)),
        out_shardings=sharding.replicated(mesh),
    ))


def jit_quant_stats_step(
    model_cfg: ModelConfig, mesh: Mesh, state_sh, *, backend: quant.Backend | None = None,
    attention_kernel: str | None = None,
):
    """The jitted `make_quant_stats_step` of `model_cfg` (its own model, whose dots measure their
    operands; `backend` and `attention_kernel` as in `build_model`), or None when no GEMM is
    quantized."""
    model = build_model(model_cfg, backend=backend, quant_stats=True, attention_kernel=attention_kernel)
    key = jax.random.PRNGKey(0)
    variables = jax.eval_shape(lambda: _init_variables(model, model_cfg.max_target_length, key, key))
    template = nn.meta.unbox(variables.get(health.COLLECTION))
    if not template:
        return None
    return _in_scope(model, sharding.sharded_jit(
        make_quant_stats_step(model, template),
        mesh,
        in_shardings=(state_sh, sharding.batch_sharding(mesh)),
        out_shardings=sharding.replicated(mesh),
    ))
