"""QuantDotGeneral: the Flax form of the seam (rng stream "quant", state in "fp8_meta")."""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_same_bits
from jax import lax

from nvfp4_jax.quant import get_recipe, init_fp8_meta
from nvfp4_jax.quant.dot import make_dot_general
from nvfp4_jax.quant.flax_dot import QuantDotGeneral, dot_general_factory, quant_rngs

DIMS = (((1,), (0,)), ((), ()))


class TwoLayers(nn.Module):
    """Two projections, each calling the factory inside the compact body, as the model does."""

    factory: Any = None

    @nn.compact
    def __call__(self, x):
        for i, features in enumerate((64, 32)):
            kernel = self.param(f"kernel_{i}", nn.initializers.normal(0.1), (x.shape[-1], features))
            dot = self.factory() if self.factory is not None else lax.dot_general
            x = dot(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
            x = jax.nn.gelu(x) if i == 0 else x
        return x


class Twins(nn.Module):
    """The same product through two projections: the layers' SR keys must differ."""

    factory: Any

    @nn.compact
    def __call__(self, xa, xb, w):
        return self.factory()(xa, w, DIMS), self.factory()(xb, w, DIMS)


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.PRNGKey(0), (2, 16, 32))


def _grads(model, variables, x, rngs, cot_seed=1):
    def f(params, x):
        return model.apply({**variables, "params": params}, x, rngs=rngs)

    y, vjp = jax.vjp(f, variables["params"], x)
    return (y, *vjp(jax.random.normal(jax.random.PRNGKey(cot_seed), y.shape, y.dtype)))


_grads_jit = jax.jit(_grads, static_argnums=0)


def _init_params(x):
    """TwoLayers' parameters, made directly (a quantized init would compile the forward)."""
    k0, k1 = jax.random.split(jax.random.PRNGKey(1))
    return {"params": {
        "kernel_0": 0.1 * jax.random.normal(k0, (x.shape[-1], 64)),
        "kernel_1": 0.1 * jax.random.normal(k1, (64, 32)),
    }}


def test_bf16_factory_is_none_and_module_is_bitwise_lax(x):
    assert dot_general_factory(get_recipe("bf16")) is None and dot_general_factory(get_recipe("")) is None
    ref_model = TwoLayers(None)
    variables = _init_params(x)
    ref = _grads_jit(ref_model, variables, x, {})
    ours = _grads_jit(TwoLayers(functools.partial(QuantDotGeneral, recipe=get_recipe("bf16"))), variables, x, {})
    assert_same_bits(ours, ref)


def test_nvfp4_module_submodules_keys_and_reproducibility(x):
    model = TwoLayers(dot_general_factory(get_recipe("te_nvfp4")))
    # init needs no "quant" stream (traced only: the parameters are all it makes).
    assert set(jax.eval_shape(model.init, jax.random.PRNGKey(1), x)) == {"params"}
    variables = _init_params(x)
    key = jax.random.PRNGKey(7)
    y1, dp1, dx1 = _grads_jit(model, variables, x, quant_rngs(key))
    y1b, dp1b, dx1b = _grads_jit(model, variables, x, quant_rngs(key))
    y2, dp2, dx2 = _grads_jit(model, variables, x, quant_rngs(jax.random.PRNGKey(8)))
    # Same step key: identical; another step key: the forward (round-to-nearest) is unchanged,
    # the stochastically rounded gradients are not.
    assert_same_bits((y1b, dp1b, dx1b), (y1, dp1, dx1))
    assert np.array_equal(np.asarray(y1), np.asarray(y2))
    assert not np.array_equal(np.asarray(dx1), np.asarray(dx2))
    assert not np.array_equal(np.asarray(dp1["kernel_0"]), np.asarray(dp2["kernel_0"]))
    # The forward equals the pure-function form's (no randomness in FPROP).
    dims = (((2,), (0,)), ((), ()))
    dot = make_dot_general(get_recipe("te_nvfp4"), key)
    forward = jax.jit(lambda x, p: dot(jax.nn.gelu(dot(x, p["kernel_0"], dims)), p["kernel_1"], dims))
    want = forward(x, variables["params"])
    assert np.array_equal(np.asarray(y1), np.asarray(want))


def test_layers_get_different_sr_keys():
    model = Twins(dot_general_factory(get_recipe("te_nvfp4")))
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
    w = jax.random.normal(jax.random.PRNGKey(1), (64, 32))
    g = jax.random.normal(jax.random.PRNGKey(2), (32, 32))
    rngs = quant_rngs(jax.random.PRNGKey(3))

    @jax.jit
    def branch_grads(x, w):
        # Both layers see the same X, W and dY; only their SR keys can differ.
        (ya, yb), vjp = jax.vjp(lambda xa, xb: model.apply({}, xa, xb, w, rngs=rngs), x, x)
        return (*vjp((g, g)), ya, yb)

    dxa, dxb, ya, yb = branch_grads(x, w)
    assert np.array_equal(np.asarray(ya), np.asarray(yb))
    assert not np.array_equal(np.asarray(dxa), np.asarray(dxb))


@pytest.mark.parametrize("flag, rn_flag", [("te_nvfp4", "nvfp4_no_sr"), ("mxfp4_nvfp4_recipe", "mxfp4")])
def test_apply_without_the_quant_stream_is_a_clear_error(x, flag, rn_flag):
    model = TwoLayers(dot_general_factory(get_recipe(flag)))
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(1), x)
    with pytest.raises(ValueError, match=rf"QuantDotGeneral\({flag}\).*needs the rng stream 'quant'.*rngs=\{{'quant': key\}}"):
        jax.eval_shape(model.apply, variables, x)
    # Round-to-nearest recipes draw nothing.
    jax.eval_shape(TwoLayers(dot_general_factory(get_recipe(rn_flag))).apply, variables, x)


def test_fp8_delayed_state_lives_in_fp8_meta_and_updates_by_gradient(x):
    model = TwoLayers(dot_general_factory(get_recipe("te_fp8_delayedscaling")))
    variables = jax.jit(model.init)(jax.random.PRNGKey(1), x)
    assert set(variables) == {"params", "fp8_meta"}
    expected = init_fp8_meta(1024)
    for layer in ("QuantDotGeneral_0", "QuantDotGeneral_1"):
        meta = variables["fp8_meta"][layer]
        assert set(meta) == set(expected)
        for k, v in expected.items():
            assert np.array_equal(np.asarray(meta[k]), np.asarray(v)), (layer, k)

    @jax.jit
    def train_step(params, fp8_meta, x):
        def loss(params, fp8_meta):
            y = model.apply({"params": params, "fp8_meta": fp8_meta}, x)
            return jnp.mean(y.astype(jnp.float32) ** 2)

        grads, new_meta = jax.grad(loss, argnums=(0, 1))(params, fp8_meta)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), new_meta

    params, meta = variables["params"], variables["fp8_meta"]
    for step in range(2):
        params, meta = train_step(params, meta, x * (step + 1))
    m0 = meta["QuantDotGeneral_0"]
    # After two steps the two newest slots hold the steps' amaxes of X (x, then 2x).
    amax_x = float(np.abs(np.asarray(x)).max())
    # A max is exact and doubling is exact: the very float32 values, not approximately.
    np.testing.assert_array_equal(np.asarray(m0["x_amax_history"][-2:]), np.float32([amax_x, 2 * amax_x]))
    assert float(m0["x_scale"][0]) == np.float32(448.0) / np.float32(2 * amax_x)
    assert (np.asarray(m0["dy_amax_history"][-2:]) > 0).all()
    assert np.asarray(m0["x_amax_history"][:-2]).sum() == 0
    # Forward-only use (eval) reads the state and needs nothing mutable.
    y = jax.jit(model.apply)({"params": params, "fp8_meta": meta}, x)
    assert np.isfinite(np.asarray(y)).all()


def test_factory_works_as_flax_dense_dot_general_cls(x):
    dense = nn.Dense(32, use_bias=False, dot_general_cls=dot_general_factory(get_recipe("nvfp4_no_sr")))
    variables = jax.jit(dense.init)(jax.random.PRNGKey(0), x)
    dot = make_dot_general(get_recipe("nvfp4_no_sr"))
    y, want = jax.jit(
        lambda v, x: (dense.apply(v, x), dot(x, v["params"]["kernel"], (((2,), (0,)), ((), ()))))
    )(variables, x)
    assert np.array_equal(np.asarray(y), np.asarray(want))


def test_quant_rngs_gives_our_stream_and_tes():
    rngs = quant_rngs(jax.random.PRNGKey(0))
    assert set(rngs) == {"quant", "sr_rng"}
    assert not np.array_equal(np.asarray(rngs["quant"]), np.asarray(rngs["sr_rng"]))


def test_the_quantized_dots_take_a_recipe_not_a_flag():
    """A flag string is resolved once, at the config (`get_recipe`); below it every entry point
    takes the `Recipe` and names the fix when handed a string."""
    from nvfp4_jax.quant import make_dot_general

    for build in (lambda: dot_general_factory("te_nvfp4"), lambda: make_dot_general("te_nvfp4")):
        with pytest.raises(TypeError, match=r"takes a Recipe, not 'te_nvfp4'.*get_recipe\('te_nvfp4'\)"):
            build()
