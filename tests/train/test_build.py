"""The config's quantization flags reach exactly the GEMMs they should."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax.config import load_config
from nvfp4_jax.model import Llama
from nvfp4_jax.quant import QuantDotGeneral, quant_rngs
from nvfp4_jax.train.build import build_model, init_state
from nvfp4_jax.train.optimizer import make_optimizer
from nvfp4_jax.train.step import make_train_step
from nvfp4_jax.sharding import make_mesh

SMALL = ["model_name=tiny", "base_num_decoder_layers=3", "max_target_length=32", "ici_fsdp_parallelism=1"]
TOKENS = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, 256)


def _cfg(*extra):
    return load_config(SMALL + list(extra)).model


@pytest.fixture(scope="module")
def params():
    return Llama(_cfg()).init(jax.random.PRNGKey(0), TOKENS)["params"]


def _quantized_dot_calls(model, params):
    """(module path, recipe flag) of every QuantDotGeneral the forward pass calls."""
    calls = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, QuantDotGeneral) and context.method_name == "__call__":
            recipe = context.module.recipe
            calls.append(("/".join(context.module.path), getattr(recipe, "name", recipe)))
        return next_fun(*args, **kwargs)

    variables = model.init({"params": jax.random.PRNGKey(0), "quant": jax.random.PRNGKey(2)}, TOKENS)
    variables = {**variables, "params": params}
    with nn.intercept_methods(record):
        model.apply(variables, TOKENS, rngs=quant_rngs(jax.random.PRNGKey(3)))
    return calls


def test_bf16_flag_is_bit_identical_to_plain_lax_dot_general(params):
    plain = Llama(_cfg()).apply({"params": params}, TOKENS)
    for flag in ("", "bf16"):
        built = build_model(_cfg(f"quantization={flag}"))
        np.testing.assert_array_equal(np.asarray(built.apply({"params": params}, TOKENS)), np.asarray(plain))


def test_te_nvfp4_quantizes_the_mlp_and_only_the_mlp(params):
    calls = _quantized_dot_calls(build_model(_cfg("quantization=te_nvfp4")), params)
    paths = sorted(p for p, _ in calls)
    expected = sorted(f"layers_{i}/mlp/{proj}/QuantDotGeneral_0" for i in range(3) for proj in ("gate", "up", "down"))
    assert paths == expected


def test_bf16_first_and_last_layers_are_not_quantized(params):
    model = build_model(_cfg("quantization=te_nvfp4", "bf16_first_layers=1", "bf16_last_layers=1"))
    paths = sorted(p for p, _ in _quantized_dot_calls(model, params))
    assert paths == sorted(f"layers_1/mlp/{proj}/QuantDotGeneral_0" for proj in ("gate", "up", "down"))


def test_attention_fp8_adds_the_four_projections(params):
    model = build_model(_cfg("quantization=te_nvfp4", "attention_quantization=fp8"))
    paths = [p for p, _ in _quantized_dot_calls(model, params)]
    attention = sorted(p for p in paths if "/attention/" in p)
    assert attention == sorted(
        f"layers_{i}/attention/{proj}/QuantDotGeneral_0" for i in range(3) for proj in ("query", "key", "value", "out")
    )
    assert len(paths) == 3 * 3 + 3 * 4


def test_quantized_forward_differs_from_bf16_but_stays_close(params):
    plain = Llama(_cfg()).apply({"params": params}, TOKENS)
    model = build_model(_cfg("quantization=te_nvfp4"))
    quantized = model.apply({"params": params}, TOKENS, rngs=quant_rngs(jax.random.PRNGKey(0)))
    diff = float(jnp.abs(quantized - plain).mean())
    assert 0 < diff < 0.25 * float(jnp.abs(plain).mean())


def test_fp8_delayed_state_is_threaded_through_the_train_step():
    cfg = load_config(SMALL + ["quantization=te_fp8_delayedscaling", "steps=10"])
    model = build_model(cfg.model)
    optimizer = make_optimizer(cfg.train)
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    state, _ = init_state(model, optimizer, 32, mesh, seed=0)
    histories = [l for p, l in jax.tree_util.tree_leaves_with_path(state.fp8_meta) if "history" in jax.tree_util.keystr(p)]
    assert len(histories) == 3 * 3 * 3  # layers x MLP projections x (x, w, dy)
    assert all(float(jnp.abs(h).max()) == 0 for h in histories)
    step = jax.jit(make_train_step(model, optimizer))
    batch = {"inputs": TOKENS, "targets": jnp.roll(TOKENS, -1, axis=1)}
    state, _ = step(state, batch)
    after = [l for p, l in jax.tree_util.tree_leaves_with_path(state.fp8_meta) if "history" in jax.tree_util.keystr(p)]
    # Every history recorded this step's amax (x, w and the gradient dy) in some slot.
    assert all(float(jnp.abs(h).max()) > 0 for h in after)
