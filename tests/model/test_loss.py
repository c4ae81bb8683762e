"""The tiled cross-entropy: the untiled loss and gradients, without whole-batch logits."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import (
    DIVISION_ROUNDINGS, FIRST_ORDER_SLACK, TRANSCENDENTAL_ROUNDINGS, U, assert_within, bf16_rounded,
    einsum_with_terms, gamma, unit_roundoff,
)

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
    """The summed cross-entropy sum_t -log softmax(h . kernel)[target] and its gradients, exact
    (float64, from the operands as given), each with the first-order bound on the rounding
    error of one fp32 evaluation (tests/tolerance.py; optax's softmax_cross_entropy and its
    autodiff, as the loss computes them):

    logits z = h . W: gamma(D) |h|.|W|; z - max(z): both errors plus u |z - max|; the
    normaliser S = sum exp: the largest of those, exp's error and gamma(V), relative; log S:
    that plus log's error; ce = log S - z_y: plus z_y's error and u |ce|; the loss: the tokens'
    errors plus gamma(N) sum|ce|. dz = softmax - onehot: p's relative error (the normaliser's,
    a division, a product) and u |dz|; dh = dz . W^T (V terms) and dW = h^T . dz (N terms):
    sums of rounded terms, their inputs' errors carried through.
    """
    h, w = np.asarray(h, np.float64), np.asarray(kernel, np.float64)
    y = np.asarray(targets)[..., None]
    n, d, v = y.size, h.shape[-1], w.shape[-1]
    trans = TRANSCENDENTAL_ROUNDINGS * U
    z, z_terms = einsum_with_terms("bld,dv->blv", h, w)
    z_err = gamma(d) * z_terms
    x = z - z.max(-1, keepdims=True)
    x_err = z_err + z_err.max(-1, keepdims=True) + U * np.abs(x)
    s = np.exp(x).sum(-1)
    s_rel = x_err.max(-1) + trans + gamma(v)
    ce = np.log(s) - np.take_along_axis(x, y, -1)[..., 0]
    ce_err = s_rel + trans * np.abs(np.log(s)) + np.take_along_axis(x_err, y, -1)[..., 0] + U * np.abs(ce)
    p = np.exp(x) / s[..., None]
    dz = p - (np.arange(v) == y)
    dz_err = p * (x_err + trans + s_rel[..., None] + (DIVISION_ROUNDINGS + 1) * U) + U * np.abs(dz)
    dh, dh_terms = einsum_with_terms("blv,dv->bld", dz, w)
    dw, dw_terms = einsum_with_terms("bld,blv->dv", h, dz)
    bounds = {
        "loss": (ce.sum(), ce_err.sum() + gamma(n) * np.abs(ce).sum()),
        "dh": (dh, np.einsum("blv,dv->bld", dz_err, np.abs(w)) + gamma(v) * dh_terms),
        "dw": (dw, np.einsum("bld,blv->dv", np.abs(h), dz_err) + gamma(n) * dw_terms),
    }
    return {k: (exact, FIRST_ORDER_SLACK * b) for k, (exact, b) in bounds.items()}, dz, dw_terms


def _value_and_grads(num_tiles, dtype):
    h, kernel, targets = _inputs()
    fn = lambda h, w: cross_entropy_sum(h, w, targets, dtype, num_tiles)  # noqa: E731
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(h, kernel)


@pytest.mark.parametrize("num_tiles", [2, 4, 32])
def test_tiled_loss_and_gradients_match_the_untiled_ones_in_fp32(num_tiles):
    loss1, (dh1, dw1) = _value_and_grads(1, jnp.float32)
    loss, (dh, dw) = _value_and_grads(num_tiles, jnp.float32)
    # Same per-token arithmetic; only the order of the sums over tokens differs. Each, tiled or
    # not, is within its fp32 bound of the exact loss and gradients (so within twice of each
    # other); a lost tile, a wrong target or a missing token is far outside.
    want, _, _ = _reference(*_inputs())
    for name, got1, got in (("loss", loss1, loss), ("dh", dh1, dh), ("dw", dw1, dw)):
        exact, bound = want[name]
        assert_within(got1, exact, bound, f"untiled {name}")
        assert_within(got, exact, bound, f"{num_tiles} tiles {name}")
    assert dw.dtype == jnp.float32


def test_tiled_kernel_gradient_adds_its_tiles_in_fp32_under_bf16_compute():
    loss1, (_, dw1) = _value_and_grads(1, jnp.bfloat16)
    loss, (_, dw) = _value_and_grads(4, jnp.bfloat16)
    h, kernel, targets = _inputs()
    # The GEMMs multiply the bf16-rounded operands, exactly, and accumulate in fp32: the fp32
    # bounds hold for the exact loss of those operands.
    want, dz, dw_terms = _reference(bf16_rounded(h), bf16_rounded(kernel), targets)
    for name, got in (("untiled loss", loss1), ("tiled loss", loss)):
        assert_within(got, *want["loss"], name)
    # dW: untiled, the bf16 GEMM rounds the whole sum once; tiled, each tile's part is rounded
    # and the parts add in fp32. Either may also round dz to bf16 on the way in (2^-8 of each
    # term, sum|terms| in all). So, against the exact dW: the fp32 bound, plus
    # u_bf16 (sum|terms| + |dW|) untiled, u_bf16 (sum|terms| + sum over tiles |tile|) + gamma(4)
    # sum|tile| tiled. bf16-sized, far above fp32 noise, as the roundings are.
    u_bf16 = unit_roundoff(jnp.bfloat16)
    exact, fp32_bound = want["dw"]
    h64 = bf16_rounded(h)
    tiles = np.abs(np.einsum("bnld,bnlv->ndv", h64.reshape(2, 4, -1, h64.shape[-1]),
                             dz.reshape(2, 4, -1, dz.shape[-1]))).sum(0)
    slack = FIRST_ORDER_SLACK  # the products of u_bf16 with the fp32 terms
    assert_within(dw1, exact, slack * (fp32_bound + u_bf16 * (dw_terms + np.abs(exact))), "untiled dw")
    assert_within(dw, exact, slack * (fp32_bound + u_bf16 * (dw_terms + tiles) + gamma(4) * tiles), "tiled dw")
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
    # The LM head's input, computed op by op (eager) like the loss method's own, from the same
    # parameters and shapes: the same bits. What is left is the head's logits and the
    # cross-entropy, whose fp32 rounding is bounded (`_reference`), and the mean's division.
    h = Llama(cfg).apply(variables, tokens, method=lambda model, t: model.features(model.embed(t)))
    kernel = nn.meta.unbox(variables)["params"]["lm_head"]["kernel"]
    total, total_bound = _reference(h, kernel, targets)[0]["loss"]
    want = total / tokens.size
    bound = total_bound / tokens.size + gamma(DIVISION_ROUNDINGS) * want
    for tiles in (1, 4):
        tiled = Llama(ModelConfig(**{**cfg.__dict__, "num_vocab_tiling": tiles}))
        loss, weights = tiled.apply(variables, tokens, targets, method=Llama.loss)
        assert float(weights) == tokens.size
        assert_within(loss, want, bound, f"{tiles} tiles")
