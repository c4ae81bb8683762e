"""From config to objects: the model with its recipe's dots, and a sharded initial state.

Init goes `eval_shape -> shardings -> jit(init, out_shardings=...)`, so no device ever holds
more than its shard of the model or optimizer state.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from nvfp4_jax import quant, sharding
from nvfp4_jax.config import ModelConfig
from nvfp4_jax.model import Llama
from nvfp4_jax.quant import health
from nvfp4_jax.train.state import TrainState
from nvfp4_jax.train.step import make_eval_step, make_quant_stats_step, make_train_step

# The attention projections' recipe when `attention_quantization=fp8` (stateless FP8).
ATTENTION_FP8_RECIPE = "te_fp8_currentscaling"


def build_model(model_cfg: ModelConfig, *, quantized: bool = True, quant_stats: bool = False) -> Llama:
    """The Llama of `model_cfg`; `quantized=False` gives the same parameters with BF16 dots.

    `quant_stats=True` gives the model of the quantization-statistics step (its dots measure
    their operands, see `quant.health`); never the one that trains.
    """
    mlp_dot = attention_dot = None
    if quantized:
        mlp_dot = quant.dot_general_factory(model_cfg.quantization, quant_stats=quant_stats)
        if model_cfg.attention_quantization == "fp8":
            attention_dot = quant.dot_general_factory(ATTENTION_FP8_RECIPE, quant_stats=quant_stats)
    return Llama(model_cfg, mlp_dot_general_cls=mlp_dot, attention_dot_general_cls=attention_dot)


def _init_boxed(model: nn.Module, optimizer: optax.GradientTransformation, seq_len: int, key):
    params_key, quant_key, run_key = jax.random.split(key, 3)
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    variables = model.init({"params": params_key, "quant": quant_key}, tokens)
    params = variables["params"]
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        fp8_meta={c: variables[c] for c in quant.OVERWRITE_WITH_GRADIENT_COLLECTIONS if c in variables},
        rng=run_key,
    )


def state_shardings(model, optimizer, seq_len: int, mesh: Mesh):
    """(abstract unboxed state with shardings, sharding pytree), without allocating anything."""
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
    init = jax.jit(
        lambda k: nn.meta.unbox(_init_boxed(model, optimizer, seq_len, k)), out_shardings=shardings
    )
    return init(jax.random.PRNGKey(seed)), shardings


def jit_train_step(model, optimizer, mesh: Mesh, state_sh, *, uses_fp8_meta: bool = True):
    """The train step, jitted with explicit shardings and donated state, traced on `mesh`."""
    return sharding.sharded_jit(
        make_train_step(model, optimizer, uses_fp8_meta=uses_fp8_meta),
        mesh,
        in_shardings=(state_sh, sharding.batch_sharding(mesh)),
        out_shardings=(state_sh, sharding.replicated(mesh)),
        donate_argnums=0,
    )


def jit_eval_step(model, mesh: Mesh, state_sh):
    return sharding.sharded_jit(
        make_eval_step(model),
        mesh,
        in_shardings=(state_sh, sharding.batch_sharding(mesh)),
        out_shardings=sharding.replicated(mesh),
    )


def jit_quant_stats_step(model_cfg: ModelConfig, seq_len: int, mesh: Mesh, state_sh):
    """The jitted `make_quant_stats_step` of `model_cfg`, or None when no GEMM is quantized."""
    model = build_model(model_cfg, quant_stats=True)
    rngs = {"params": jax.random.PRNGKey(0), "quant": jax.random.PRNGKey(0)}
    variables = jax.eval_shape(lambda: model.init(rngs, jnp.zeros((1, seq_len), jnp.int32)))
    template = variables.get(health.COLLECTION)
    if not template:
        return None
    return sharding.sharded_jit(
        make_quant_stats_step(model, template),
        mesh,
        in_shardings=(state_sh, sharding.batch_sharding(mesh)),
        out_shardings=sharding.replicated(mesh),
    )
