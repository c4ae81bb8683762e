"""The tiled cross-entropy: the untiled loss and gradients, without whole-batch logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax.config import ModelConfig
from nvfp4_jax.model import Llama
from nvfp4_jax.model.loss import cross_entropy_sum

B, L, D, V = 2, 32, 16, 40


def _inputs():
    kh, kw, kt = jax.random.split(jax.random.PRNGKey(0), 3)
    h = jax.random.normal(kh, (B, L, D), jnp.float32)
    kernel = jax.random.normal(kw, (D, V), jnp.float32) / 4
    targets = jax.random.randint(kt, (B, L), 0, V)
    return h, kernel, targets


def _reference(h, kernel, targets):
    """float64 numpy: sum of -log softmax(h . kernel)[target]."""
    logits = np.einsum("bld,dv->blv", np.asarray(h, np.float64), np.asarray(kernel, np.float64))
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, np.asarray(targets)[..., None], -1).sum()


def _value_and_grads(num_tiles, dtype):
    h, kernel, targets = _inputs()
    fn = lambda h, w: cross_entropy_sum(h, w, targets, dtype, num_tiles)  # noqa: E731
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(h, kernel)


@pytest.mark.parametrize("num_tiles", [2, 4, 32])
def test_tiled_loss_and_gradients_match_the_untiled_ones_in_fp32(num_tiles):
    loss1, (dh1, dw1) = _value_and_grads(1, jnp.float32)
    loss, (dh, dw) = _value_and_grads(num_tiles, jnp.float32)
    assert abs(float(loss1) - _reference(*_inputs())) < 1e-6 * abs(float(loss1))
    # Same per-token arithmetic; only the order of the sums over tokens differs.
    np.testing.assert_allclose(float(loss), float(loss1), rtol=1e-6)
    np.testing.assert_allclose(dh, dh1, rtol=0, atol=1e-6 * float(jnp.abs(dh1).max()))
    np.testing.assert_allclose(dw, dw1, rtol=0, atol=1e-6 * float(jnp.abs(dw1).max()))
    assert dw.dtype == jnp.float32


def test_tiled_kernel_gradient_adds_its_tiles_in_fp32_under_bf16_compute():
    loss1, (_, dw1) = _value_and_grads(1, jnp.bfloat16)
    loss, (_, dw) = _value_and_grads(4, jnp.bfloat16)
    np.testing.assert_allclose(float(loss), float(loss1), rtol=1e-6)
    # Untiled, the bf16 GEMM rounds the whole sum once (2^-9 relative); tiled, each tile's part
    # is rounded and the parts add in fp32: within one bf16 rounding of each other.
    np.testing.assert_allclose(dw, dw1, rtol=0, atol=2**-8 * float(jnp.abs(dw1).max()))
    assert not np.array_equal(np.asarray(dw), np.asarray(dw.astype(jnp.bfloat16).astype(jnp.float32)))


def _jaxprs_in_params(params):
    import jax.extend.core  # noqa: F401  (jax.extend is imported lazily)

    find = getattr(jax.extend.core, "jaxprs_in_params", None) or jax.core.jaxprs_in_params
    return find(params)


def _shapes_in(jaxpr) -> set[tuple[int, ...]]:
    """Shapes of every value a jaxpr (and the jaxprs inside it) produces."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes |= {tuple(v.aval.shape) for v in eqn.outvars}
        for sub in _jaxprs_in_params(eqn.params):
            shapes |= _shapes_in(sub)
    return shapes


@pytest.mark.parametrize("num_tiles", [1, 4])
def test_the_step_never_holds_logits_for_the_whole_batch(num_tiles):
    h, kernel, targets = _inputs()
    grad = jax.grad(lambda h, w: cross_entropy_sum(h, w, targets, jnp.bfloat16, num_tiles), argnums=(0, 1))
    shapes = _shapes_in(jax.make_jaxpr(grad)(h, kernel).jaxpr)
    assert (B, L // num_tiles, V) in shapes
    assert ((B, L, V) in shapes) == (num_tiles == 1)


def test_llama_loss_is_the_mean_cross_entropy_of_its_logits_tiled_or_not():
    cfg = ModelConfig(vocab_size=64, base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=1,
                      head_dim=16, base_mlp_dim=64, base_num_decoder_layers=2, max_target_length=16,
                      dtype="float32")
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 64)
    targets = jnp.roll(tokens, -1, axis=1)
    variables = jax.jit(Llama(cfg).init)(jax.random.PRNGKey(0), tokens)
    logits = np.asarray(Llama(cfg).apply(variables, tokens), np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, np.asarray(targets)[..., None], -1).mean()
    for tiles in (1, 4):
        tiled = Llama(ModelConfig(**{**cfg.__dict__, "num_vocab_tiling": tiles}))
        loss, weights = tiled.apply(variables, tokens, targets, method=Llama.loss)
        assert float(weights) == tokens.size
        np.testing.assert_allclose(float(loss), want, rtol=1e-6)
