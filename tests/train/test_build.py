"""The config's quantization flags reach exactly the GEMMs they should."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax.config import load_config
from nvfp4_jax.model import Llama
from nvfp4_jax.quant import QuantDotGeneral, quant_rngs
from nvfp4_jax.quant.recipe import get_recipe, recipe_name
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
    """{projection path: recipe flag} of every QuantDotGeneral the forward pass calls; a
    projection absent from it runs `lax.dot_general` (BF16)."""
    calls = {}

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, QuantDotGeneral) and context.method_name == "__call__":
            path = "/".join(context.module.path)
            assert path.endswith("/QuantDotGeneral_0"), path
            projection = path[: -len("/QuantDotGeneral_0")]
            assert projection not in calls, f"{projection} quantized twice"
            calls[projection] = recipe_name(context.module.recipe)
        return next_fun(*args, **kwargs)

    variables = model.init({"params": jax.random.PRNGKey(0), "quant": jax.random.PRNGKey(2)}, TOKENS)
    variables = {**variables, "params": params}
    with nn.intercept_methods(record):
        model.apply(variables, TOKENS, rngs=quant_rngs(jax.random.PRNGKey(3)))
    return calls


MLP = ("gate", "up", "down")
ATTENTION = ("query", "key", "value", "out")


def _expected(mlp: str, attention: str | None = None, bf16_layers=()):
    """The recipe each projection must get, in a 3-layer model."""
    out = {}
    for i in range(3):
        if i in bf16_layers:
            continue
        out.update({f"layers_{i}/mlp/{p}": mlp for p in MLP})
        if attention:
            out.update({f"layers_{i}/attention/{p}": attention for p in ATTENTION})
    return out


def test_bf16_flag_is_bit_identical_to_plain_lax_dot_general(params):
    plain = Llama(_cfg()).apply({"params": params}, TOKENS)
    for flag in ("", "bf16"):
        built = build_model(_cfg(f"quantization={flag}"))
        np.testing.assert_array_equal(np.asarray(built.apply({"params": params}, TOKENS)), np.asarray(plain))
        assert _quantized_dot_calls(built, params) == {}


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["te_nvfp4", "te_fp8_delayedscaling", "mxfp4"])
def test_the_mlp_gets_the_recipe_and_attention_stays_bf16(params, flag):
    # Attention in BF16: no attention projection may reach a quantized dot.
    assert _quantized_dot_calls(build_model(_cfg(f"quantization={flag}")), params) == _expected(flag)


def test_bf16_first_and_last_layers_get_no_quantized_dot(params):
    model = build_model(_cfg("quantization=te_nvfp4", "attention_quantization=fp8",
                             "bf16_first_layers=1", "bf16_last_layers=1"))
    assert _quantized_dot_calls(model, params) == _expected("te_nvfp4", "te_fp8_currentscaling", bf16_layers=(0, 2))


def test_attention_fp8_gives_the_four_attention_projections_fp8_not_nvfp4(params):
    model = build_model(_cfg("quantization=te_nvfp4", "attention_quantization=fp8"))
    calls = _quantized_dot_calls(model, params)
    assert calls == _expected("te_nvfp4", "te_fp8_currentscaling")
    assert {calls[f"layers_{i}/attention/{p}"] for i in range(3) for p in ATTENTION} == {"te_fp8_currentscaling"}


def test_quantized_forward_differs_from_bf16_but_stays_close(params):
    plain = Llama(_cfg()).apply({"params": params}, TOKENS)
    model = build_model(_cfg("quantization=te_nvfp4"))
    quantized = model.apply({"params": params}, TOKENS, rngs=quant_rngs(jax.random.PRNGKey(0)))
    diff = float(jnp.abs(quantized - plain).mean())
    assert 0 < diff < 0.25 * float(jnp.abs(plain).mean())


@pytest.mark.slow
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
